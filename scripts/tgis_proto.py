"""Python stubs for this repository's .proto files, generated on first use with grpcio-tools
(into a temporary directory), so clients need no generated code checked in."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
_stub_dir: str | None = None


def load(name: str):
    """Returns (<name>_pb2, <name>_pb2_grpc) for proto/<name>.proto."""
    global _stub_dir
    if _stub_dir is None:
        from grpc_tools import protoc

        _stub_dir = tempfile.mkdtemp(prefix="tgis-stubs-")
        for proto in sorted(PROTO_DIR.glob("*.proto")):
            rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={_stub_dir}",
                              f"--grpc_python_out={_stub_dir}", str(proto)])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {proto}")
        sys.path.insert(0, _stub_dir)
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")

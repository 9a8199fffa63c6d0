"""Python stubs for this repository's .proto files, generated on first use with grpcio-tools
(into a temporary directory), so clients need no generated code checked in.

protoc runs in a child process: importing grpc_tools' compiler would load a second protobuf
runtime into the caller, beside the one that other native extensions (sentencepiece) carry,
and the two have aborted each other in one process."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
_stub_dir: str | None = None


def load(name: str):
    """Returns (<name>_pb2, <name>_pb2_grpc) for proto/<name>.proto."""
    global _stub_dir
    if _stub_dir is None:
        stub_dir = tempfile.mkdtemp(prefix="tgis-stubs-")
        protos = [str(p) for p in sorted(PROTO_DIR.glob("*.proto"))]
        run = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
                              f"--python_out={stub_dir}", f"--grpc_python_out={stub_dir}", *protos],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR}: {run.stderr.strip()}")
        _stub_dir = stub_dir
        sys.path.insert(0, _stub_dir)
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")

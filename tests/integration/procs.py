"""Helpers for integration tests that run the real binaries: where they are, generated gRPC
stubs for the repository's .proto files, and a process that is always cleaned up."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import tgis_proto  # noqa: E402
FIXTURES = REPO_ROOT / "tests" / "fixtures"


def build_dir() -> Path:
    return Path(os.environ.get("TGIS_BUILD_DIR", REPO_ROOT / "build"))


def binary(relative: str) -> Path:
    return build_dir() / relative


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()
_PORTS = random.Random()


def free_port() -> int:
    """A TCP port free on every address right now, below the kernel's ephemeral range and
    never handed out before in this process. A port from bind(0) would come from the
    ephemeral range, where every outgoing connection (gRPC clients, Gloo) also takes its
    local port, so a server started a moment later could find it taken."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = _PORTS.randrange(10000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def children_of(pid: int) -> list[int]:
    """The process ids whose parent is `pid` (from /proc)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(p.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def need_binaries():
    """Skips the calling test unless the launcher, shard and router are built."""
    import pytest

    for b in ("launcher/text-generation-launcher", "server/text-generation-server",
              "router/text-generation-router"):
        if not binary(b).exists():
            pytest.skip(f"{binary(b)} not built")


def proto_module(name: str):
    """Imports <name>_pb2 and <name>_pb2_grpc generated from proto/<name>.proto."""
    return tgis_proto.load(name)


class Process:
    """A child process whose output goes to a log file; stopped on close()."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.log = tempfile.NamedTemporaryFile(prefix="tgis-proc-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen([str(a) for a in args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env)
        # gRPC channels to this process, closed with it: a channel left to the garbage collector
        # is finalized whenever a later test happens to collect it.
        self.channels = []

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "ready"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            if not self.alive():
                raise RuntimeError(f"process exited ({self.proc.returncode}) before {what}:\n"
                                   f"{self.output()}")
            time.sleep(0.05)
        raise TimeoutError(f"not {what} after {timeout}s:\n{self.output()}")

    def close(self, sig_timeout: float = 10.0) -> int | None:
        for channel in self.channels:
            channel.close()
        self.channels.clear()
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=sig_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_serving(proc: "Process", grpc_port: int, timeout: float = 60.0):
    """Waits until the router behind `proc` (a launcher or router) answers ModelInfo on
    `grpc_port`; returns (channel, pb, stub) of the public GenerationService."""
    import grpc

    pb, pb_grpc = proto_module("generation")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    proc.channels.append(channel)  # closed with the process
    stub = pb_grpc.GenerationServiceStub(channel)

    def ready():
        try:
            stub.ModelInfo(pb.ModelInfoRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False

    proc.wait_for(ready, timeout=timeout, what="serving gRPC")
    return channel, pb, stub

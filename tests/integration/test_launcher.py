"""text-generation-launcher lifecycle against the real shard and router binaries: model
resolution errors, start-up, SIGTERM drain, a dying shard, a SIGKILLed launcher (no orphan
shard), JSON log lines."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import (FIXTURES, Process, alive, binary, children_of, cmdline, free_port,  # noqa: E402
                   need_binaries, proto_module)

grpc = pytest.importorskip("grpc")
MODEL = FIXTURES / "models" / "llama"


class Launcher:
    def __init__(self, tmp: Path, extra_env: dict | None = None, model=MODEL):
        self.grpc_port = free_port()
        self.termination_log = tmp / "termination-log"
        env = {"MODEL_NAME": str(model), "GRPC_PORT": str(self.grpc_port), "PORT": str(free_port()),
               "SHARD_UDS_PATH": str(tmp / "shard"), "TERMINATION_LOG": str(self.termination_log),
               "KV_CACHE_BLOCKS": "64", "SHUTDOWN_GRACE_PERIOD": "10"}
        env.update(extra_env or {})
        self.proc = Process([binary("launcher/text-generation-launcher")], env=env)

    def wait_serving(self, timeout=90):
        pb, pb_grpc = proto_module("generation")
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

        def ready():
            try:
                pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=1)
                return True
            except grpc.RpcError:
                return False

        self.proc.wait_for(ready, timeout=timeout, what="serving gRPC")
        return channel

    def shard_pids(self):
        return [c for c in children_of(self.proc.proc.pid) if "serve" in cmdline(c)]


def test_missing_model_fails_naming_where_it_looked(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path, {"MODEL_NAME": "org/not-there", "HF_HUB_CACHE": str(tmp_path / "cache")})
    rc = launcher.proc.proc.wait(timeout=30)
    assert rc != 0
    out = launcher.proc.output()
    assert "org/not-there" in out and str(tmp_path / "cache") in out
    assert "org/not-there" in launcher.termination_log.read_text()


def test_model_from_hf_cache_layout(tmp_path):
    need_binaries()
    cache = tmp_path / "hub"
    snap = cache / "models--tiny--llama" / "snapshots" / "0123abc"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(MODEL.resolve())
    (cache / "models--tiny--llama" / "refs").mkdir()
    (cache / "models--tiny--llama" / "refs" / "main").write_text("0123abc")
    launcher = Launcher(tmp_path, {"MODEL_NAME": "tiny/llama", "HF_HUB_CACHE": str(cache)})
    try:
        launcher.wait_serving()
        assert str(snap) in launcher.proc.output()
    finally:
        launcher.proc.close()


def test_sigterm_drains_and_exits_zero(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path)
    channel = launcher.wait_serving()
    pb, pb_grpc = proto_module("generation")
    stub = pb_grpc.GenerationServiceStub(channel)
    # A request in flight when SIGTERM arrives still completes.
    future = stub.Generate.future(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="Hello world!")],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=40, min_new_tokens=40))))
    time.sleep(0.2)
    shards = launcher.shard_pids()
    assert shards, "no shard child found"
    launcher.proc.proc.send_signal(signal.SIGTERM)
    response = future.result(timeout=60)
    assert response.responses[0].generated_token_count == 40
    assert launcher.proc.proc.wait(timeout=60) == 0
    for pid in shards:
        assert not alive(pid)


def test_dead_shard_takes_launcher_down_with_reason(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path)
    launcher.wait_serving()
    shard = launcher.shard_pids()[0]
    os.kill(shard, signal.SIGKILL)
    rc = launcher.proc.proc.wait(timeout=60)
    assert rc != 0
    reason = launcher.termination_log.read_text()
    assert "shard-0" in reason and "signal 9" in reason


def test_sigkilled_launcher_leaves_no_orphan(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path)
    launcher.wait_serving()
    kids = children_of(launcher.proc.proc.pid)
    assert kids
    launcher.proc.proc.kill()
    launcher.proc.proc.wait(timeout=10)
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(k) for k in kids):
        time.sleep(0.1)
    assert not any(alive(k) for k in kids), [cmdline(k) for k in kids if alive(k)]


def test_json_output(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path, {"JSON_OUTPUT": "true"})
    try:
        launcher.wait_serving()
    finally:
        launcher.proc.close()
    lines = [l for l in launcher.proc.output().splitlines() if l.strip()]
    records = [json.loads(l) for l in lines]
    targets = {r["target"] for r in records}
    assert {"launcher", "shard-0", "router"} <= targets
    assert all("timestamp" in r and "level" in r and "message" in r["fields"] for r in records)

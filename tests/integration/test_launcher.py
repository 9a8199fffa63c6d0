"""text-generation-launcher lifecycle against the real shard and router binaries: model
resolution errors, start-up, SIGTERM drain, a dying shard, a SIGKILLed launcher (no orphan
shard), JSON log lines; and its command line, which is TGIS's launcher's: a TGIS deployment's
flags and variables serve, --help lists them, values this server cannot honour fail at start."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import (FIXTURES, Process, alive, binary, children_of, cmdline, free_port,  # noqa: E402
                   need_binaries, proto_module, wait_serving)

grpc = pytest.importorskip("grpc")
MODEL = FIXTURES / "models" / "llama"
GPT2 = FIXTURES / "models" / "gpt2"
LAUNCHER = "launcher/text-generation-launcher"


class Launcher:
    def __init__(self, tmp: Path, extra_env: dict | None = None, model=MODEL, args=()):
        self.grpc_port = free_port()
        self.termination_log = tmp / "termination-log"
        env = {"MODEL_NAME": str(model), "GRPC_PORT": str(self.grpc_port), "PORT": str(free_port()),
               "SHARD_UDS_PATH": str(tmp / "shard"), "TERMINATION_LOG": str(self.termination_log),
               "KV_CACHE_BLOCKS": "64", "SHUTDOWN_GRACE_PERIOD": "10"}
        env.update(extra_env or {})
        self.proc = Process([binary(LAUNCHER), *args], env=env)

    def wait_serving(self, timeout=90):
        return wait_serving(self.proc, self.grpc_port, timeout)[0]

    def shard_pids(self):
        return [c for c in children_of(self.proc.proc.pid) if "serve" in cmdline(c)]


def test_missing_model_fails_naming_where_it_looked(tmp_path):
    need_binaries()
    launcher = Launcher(tmp_path, {"MODEL_NAME": "org/not-there", "HF_HUB_CACHE": str(tmp_path / "cache"),
                                   "HF_HUB_OFFLINE": "1"})
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


# Every flag of TGIS's launcher (launcher/src/main.rs, struct Args) and its environment variable.
TGIS_FLAGS = ["model-name", "revision", "deployment-framework", "dtype", "dtype-str", "quantize",
              "num-shard", "max-concurrent-requests", "max-sequence-length", "max-new-tokens",
              "max-batch-size", "max-prefill-padding", "batch-safety-margin", "max-waiting-tokens",
              "port", "grpc-port", "shard-uds-path", "master-addr", "master-port", "json-output",
              "tls-cert-path", "tls-key-path", "tls-client-ca-cert-path", "output-special-tokens",
              "cuda-process-memory-fraction", "default-include-stop-seqs", "otlp-endpoint",
              "otlp-service-name"]


def run_launcher(args, env=None, timeout=30):
    """Runs the launcher to its exit; returns (rc, stdout + stderr)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    p = subprocess.run([str(binary(LAUNCHER)), *args], env=full_env, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def generate(channel, text="Hello world", max_new_tokens=5):
    pb, pb_grpc = proto_module("generation")
    return pb_grpc.GenerationServiceStub(channel).Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))),
        timeout=60)


def child_cmdlines(launcher):
    """The router's and the shards' command lines, with '_' for '-' in them: the children
    rewrite --some-flag to --some_flag in their argv, which is what /proc shows."""
    kids = [cmdline(c).replace("-", "_") for c in children_of(launcher.proc.proc.pid)]
    router = [k for k in kids if "text_generation_router" in k]
    shards = [k for k in kids if " serve " in k]
    return router, shards


# A TGIS deployment's settings, as flags and as its environment variables: both must serve,
# and reach the router and the shards.
TGIS_DEPLOYMENT_ARGS = ["--deployment-framework", "hf_transformers", "--dtype-str", "float32",
                        "--max-prefill-padding", "0.2", "--batch-safety-margin", "20", "-c", "1.0",
                        "--default-include-stop-seqs", "false", "--max-concurrent-requests", "64",
                        "--max-new-tokens", "100", "--max-batch-size", "4",
                        "--max-waiting-tokens", "12", "--output-special-tokens=false"]
TGIS_DEPLOYMENT_ENV = {"DEPLOYMENT_FRAMEWORK": "tgis_native", "DTYPE_STR": "float32",
                       "MAX_PREFILL_PADDING": "0.2", "BATCH_SAFETY_MARGIN": "20",
                       "CUDA_PROCESS_MEMORY_FRACTION": "1.0", "DEFAULT_INCLUDE_STOP_SEQS": "false",
                       "MAX_CONCURRENT_REQUESTS": "64", "MAX_NEW_TOKENS": "100",
                       "MAX_BATCH_SIZE": "4", "MAX_WAITING_TOKENS": "12",
                       "OUTPUT_SPECIAL_TOKENS": "false", "JSON_OUTPUT": "false"}


@pytest.mark.parametrize("form", ["flags", "env"])
def test_tgis_deployment_settings_serve(form, tmp_path):
    need_binaries()
    if form == "flags":
        launcher = Launcher(tmp_path, model=GPT2, args=TGIS_DEPLOYMENT_ARGS)
    else:
        launcher = Launcher(tmp_path, {**TGIS_DEPLOYMENT_ENV}, model=GPT2)
    try:
        channel = launcher.wait_serving()
        response = generate(channel)
        assert response.responses[0].generated_token_count == 5
        router, shards = child_cmdlines(launcher)
        assert len(router) == 1 and len(shards) == 1, (router, shards)
        for passed in ["--max_prefill_padding=0.2", "--default-include-stop-seqs=false",
                       "--max-concurrent-requests 64", "--max-new-tokens 100",
                       "--max-batch-size 4", "--max-waiting-tokens 12"]:
            assert passed.replace("-", "_") in router[0], router[0]
        for passed in ["--cuda_process_memory_fraction=1", "--batch_safety_margin=20",
                       "--dtype float32"]:
            assert passed.replace("-", "_") in shards[0], shards[0]
        assert "Launcher args: " in launcher.proc.output()
    finally:
        launcher.proc.close()


def test_num_shard_from_cuda_visible_devices(tmp_path):
    """As TGIS: with neither NUM_SHARD nor NUM_GPUS, one shard per CUDA_VISIBLE_DEVICES entry."""
    need_binaries()
    master_port = free_port()
    launcher = Launcher(tmp_path, {"CUDA_VISIBLE_DEVICES": "0,1", "TGIS_DEVICE": "cpu",
                                   "MASTER_PORT": str(master_port)}, model=GPT2)
    try:
        channel = launcher.wait_serving()
        assert generate(channel).responses[0].generated_token_count == 5
        assert len(launcher.shard_pids()) == 2
        assert "Inferring num_shard = 2 from CUDA_VISIBLE_DEVICES" in launcher.proc.output()
    finally:
        launcher.proc.close()
        shutil.rmtree(Path(tempfile.gettempdir()) / f"tgis-rendezvous-localhost-{master_port}",
                      ignore_errors=True)


def test_help_lists_every_tgis_flag_with_its_variable():
    need_binaries()
    rc, out = run_launcher(["--help"])
    assert rc == 0
    for flag in TGIS_FLAGS:
        env = flag.upper().replace("-", "_")
        # The flag's own entry: "--flag <ENV>" or "--flag [<true|false>]", then "[env: ENV]"
        # on that line or the next.
        m = re.search(rf"--{flag} (<{env}>|\[<true\|false>\])\s+\[env: {env}\]", out)
        assert m, f"--{flag} with [env: {env}] missing from --help"
    for short, flag in [("-p", "--port"), ("-g", "--grpc-port"),
                        ("-c", "--cuda-process-memory-fraction")]:
        assert f"{short}, {flag}" in out
    assert "no effect here" in out
    assert "flagfile" not in out  # ours, not gflags' list
    rc, out = run_launcher(["--version"])
    assert rc == 0 and out.startswith("text-generation-launcher ")


@pytest.mark.parametrize("args,env,expected", [
    (["--quantize", "nf4"], {}, ["--quantize", "nf4", "gptq, bitsandbytes, bitsandbytes-nf4"]),
    ([], {"QUANTIZE": "fp4"}, ["QUANTIZE", "is not a quantization method"]),
    (["--dtype-str", "float64"], {}, ["--dtype-str", "float16", "bfloat16", "float32"]),
    (["--dtype", "float16", "--dtype-str", "float32"], {},
     ["dtype and dtype_str args both provided with different values"]),
    (["-c", "1.5"], {}, ["cuda_process_memory_fraction must be in range 0 < x <= 1"]),
    (["--deployment-framework", "vllm"], {}, ["--deployment-framework", "hf_transformers"]),
    ([], {"NUM_GPUS": "2", "NUM_SHARD": "4"},
     ["NUM_GPUS and num_shard are set to different values (2 and 4)"]),
    (["--no-such-flag"], {}, ["unknown flag '--no-such-flag'"]),
    (["--max-batch-size", "many"], {}, ["'--max-batch-size'", "integer"]),
    ([], {"JSON_OUTPUT": "1"}, ["JSON_OUTPUT", "true or false"]),
])
def test_values_not_honoured_fail_at_start(args, env, expected, tmp_path):
    need_binaries()
    log = tmp_path / "termination-log"
    rc, out = run_launcher(args, {"MODEL_NAME": str(GPT2), "TERMINATION_LOG": str(log),
                                  "SHARD_UDS_PATH": str(tmp_path / "shard"), **env})
    assert rc != 0
    for part in expected:
        assert part in out, out
    assert "[shard-0]" not in out and "[router]" not in out  # nothing was started
    assert expected[-1] in log.read_text()


def slow_shard_bin_dir(tmp_path: Path) -> Path:
    """A --bin-dir whose shard never listens (it sleeps) and whose router is the real one."""
    d = tmp_path / "bin"
    d.mkdir()
    fake = d / "text-generation-server"
    fake.write_text("#!/bin/sh\nexec sleep 120\n")
    fake.chmod(0o755)
    (d / "text-generation-router").symlink_to(binary("router/text-generation-router"))
    return d


@pytest.mark.parametrize("case", ["tls", "tokenizer", "port"])
def test_router_input_errors_fail_before_the_shards_have_loaded(case, tmp_path):
    """The router starts beside the shards: a bad TLS file, a broken tokenizer.json or a gRPC
    port in use fails the launch within seconds, while the shard is still 'loading'."""
    if not binary("launcher/text-generation-launcher").exists():
        pytest.skip("launcher not built")
    import socket
    import time

    model = tmp_path / "model"
    shutil.copytree(GPT2, model)
    env = {"MODEL_NAME": str(model), "GRPC_PORT": str(free_port()), "PORT": str(free_port()),
           "SHARD_UDS_PATH": str(tmp_path / "shard"),
           "TERMINATION_LOG": str(tmp_path / "termination-log")}
    holder = None
    if case == "tls":
        env |= {"TLS_CERT_PATH": str(tmp_path / "missing.crt"),
                "TLS_KEY_PATH": str(tmp_path / "missing.key")}
        expected = "missing.crt"
    elif case == "tokenizer":
        (model / "tokenizer.json").write_text("{not json")
        expected = "tokenizer.json"
    else:
        holder = socket.socket()
        holder.bind(("0.0.0.0", 0))
        holder.listen(1)
        env["GRPC_PORT"] = str(holder.getsockname()[1])
        expected = f"--grpc-port (GRPC_PORT) {env['GRPC_PORT']}"
    started = time.monotonic()
    rc, out = run_launcher(["--bin-dir", str(slow_shard_bin_dir(tmp_path))], env)
    try:
        assert rc != 0
        assert time.monotonic() - started < 30
        reason = (tmp_path / "termination-log").read_text()
        assert expected in reason, reason
        assert "shard 0 ready" not in out
    finally:
        if holder is not None:
            holder.close()

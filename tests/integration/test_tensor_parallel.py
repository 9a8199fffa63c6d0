"""Tensor parallelism on the CPU: two shards (each with its slice of the weights, running every
step together over Gloo) through the real launcher (NUM_SHARD=2) and router generate what
transformers does with the whole model (golden.json) for every fixture architecture: greedy ids
(from the router's token details), their logprobs and the prompt's logprobs within 1e-4. Also:
the shards agree on the KV cache size at Warmup, and a model that does not split over the world
size fails at start-up with the reason. Mamba-2 mixers split by heads, their groups split or
shared (Granite 4.0-H's one group is on every rank): four shards over the fixture's two groups
take the shared case."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import (FIXTURES, Process, binary, free_port, need_binaries, proto_module,  # noqa: E402
                   wait_serving)

grpc = pytest.importorskip("grpc")

TOLERANCE = 1e-4


MODELS = sorted(d.name for d in (FIXTURES / "models").iterdir() if (d / "golden.json").exists())


def rendezvous_dir(port: int) -> Path:
    """The server's default rendezvous directory for MASTER_ADDR=localhost:port."""
    return Path(tempfile.gettempdir()) / f"tgis-rendezvous-localhost-{port}"


class Launcher:
    def __init__(self, tmp: Path, model: str, num_shard: int, extra_env: dict | None = None):
        self.grpc_port = free_port()
        self.master_port = free_port()
        self.termination_log = tmp / "termination-log"
        env = {"MODEL_NAME": str(FIXTURES / "models" / model), "NUM_SHARD": str(num_shard),
               "GRPC_PORT": str(self.grpc_port), "PORT": str(free_port()),
               "MASTER_PORT": str(self.master_port), "SHARD_UDS_PATH": str(tmp / "shard"),
               "TERMINATION_LOG": str(self.termination_log), "KV_CACHE_BLOCKS": "64",
               "KV_CACHE_BLOCK_SIZE": "4", "SHUTDOWN_GRACE_PERIOD": "5", **(extra_env or {})}
        self.proc = Process([binary("launcher/text-generation-launcher")], env=env)

    def wait_serving(self, timeout=60):
        _, pb, stub = wait_serving(self.proc, self.grpc_port, timeout)
        return pb, stub

    def close(self):
        self.proc.close()  # closes the channel too
        shutil.rmtree(rendezvous_dir(self.master_port), ignore_errors=True)


@pytest.mark.parametrize("model", MODELS)
def test_two_shards_match_the_goldens(model, tmp_path):
    check_against_the_goldens(model, 2, tmp_path)


def test_mamba_groups_shared_by_ranks_match_the_goldens(tmp_path):
    """granite4_h's mixer has 8 heads in 2 groups: over 4 ranks each pair of ranks reads the
    same group's B and C (the layout of Granite 4.0-H's one group at any world size), and the
    gated norm spans all four ranks' heads."""
    check_against_the_goldens("granite4_h", 4, tmp_path)


def check_against_the_goldens(model, num_shard, tmp_path):
    need_binaries()
    from tokenizers import Tokenizer

    model_dir = FIXTURES / "models" / model
    golden = json.loads((model_dir / "golden.json").read_text())
    prompts = golden["prompts"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # A dense checkpoint whose goldens are of it quantized at load: QUANTIZE through the
    # launcher to both shards.
    quantize = {"QUANTIZE": golden["quantize"]} if "quantize" in golden else {}
    launcher = Launcher(tmp_path, model, num_shard=num_shard, extra_env=quantize)
    try:
        pb, stub = launcher.wait_serving()
        steps = len(prompts[0]["generated_ids"])
        params = pb.Parameters(
            stopping=pb.StoppingCriteria(max_new_tokens=steps),
            response=pb.ResponseOptions(generated_tokens=True, input_tokens=True,
                                        token_logprobs=True, token_ranks=True))
        responses = stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=p["text"]) for p in prompts], params=params),
            timeout=60).responses
        assert len(responses) == len(prompts)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            assert r.input_token_count == len(p["input_ids"]), i
            assert r.generated_token_count == len(p["generated_ids"]) == steps, i
            ids = [tokenizer.token_to_id(t.text) for t in r.tokens]
            assert ids == p["generated_ids"], f"prompt {i}"
            assert [t.rank for t in r.tokens] == [1] * steps
            for k, (t, want) in enumerate(zip(r.tokens, p["logprobs"])):
                assert abs(t.logprob - want) <= TOLERANCE, f"prompt {i} step {k}"
            assert [tokenizer.token_to_id(t.text) for t in r.input_tokens] == p["input_ids"]
            for k in range(1, len(p["input_ids"])):
                got, want = r.input_tokens[k].logprob, p["prompt_logprobs"][k]
                assert abs(got - want) <= TOLERANCE, f"prompt {i} input token {k}"
        out = launcher.proc.output()
        # Both shards ran, each with its slice (not two whole models side by side).
        assert all(f"rank {r} of {num_shard}" in out for r in range(num_shard)), out
        # ... and each with its share of the CPUs, not all of them twice over.
        if "TGIS_CPU_THREADS" not in os.environ:
            threads = [int(n) for n in re.findall(r"CPU kernels: [^\n]*?, (\d+) threads", out)]
            assert len(threads) == num_shard, out
            share = max(1, len(os.sched_getaffinity(0)) // num_shard)
            assert all(1 <= n <= share for n in threads), (threads, share)
    finally:
        launcher.close()


def test_shards_agree_on_kv_cache_blocks(tmp_path):
    """Shards that could hold different numbers of KV blocks all take the smallest at Warmup."""
    server = binary("server/text-generation-server")
    if not server.exists():
        pytest.skip(f"{server} not built")
    pb, pb_grpc = proto_module("generate")
    model = FIXTURES / "models" / "llama"
    uds = str(tmp_path / "shard")
    rendezvous = tmp_path / "rendezvous"
    shards = [Process([server, "serve", model, "--uds-path", uds, "--rank", str(rank),
                       "--world-size", "2", "--rendezvous-dir", rendezvous,
                       "--kv-cache-blocks", str(blocks), "--block-size", "4"])
              for rank, blocks in ((0, 64), (1, 40))]
    channels = []
    try:
        stubs = []
        for rank, shard in enumerate(shards):
            shard.wait_for(lambda: os.path.exists(f"{uds}-{rank}"), what="listening")
            channels.append(grpc.insecure_channel(f"unix://{uds}-{rank}"))
            grpc.channel_ready_future(channels[-1]).result(timeout=30)
            stubs.append(pb_grpc.TextGenerationServiceStub(channels[-1]))
        infos = [s.Info(pb.InfoRequest()) for s in stubs]
        assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
        # Collectives need every shard in the call: send Warmup to both at once, as the router.
        results = [None, None]

        def warm(k):
            results[k] = stubs[k].Warmup(pb.WarmupRequest(max_input_length=16), timeout=60)

        threads = [threading.Thread(target=warm, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.num_blocks for r in results] == [40, 40]
        assert [r.max_supported_total_tokens for r in results] == [160, 160]
    finally:
        for c in channels:
            c.close()
        for s in shards:
            s.close()


def test_a_model_that_does_not_split_fails_with_the_reason(tmp_path):
    """4 attention heads over 3 shards: the launcher exits non-zero naming the problem."""
    need_binaries()
    launcher = Launcher(tmp_path, "llama", num_shard=3)
    try:
        rc = launcher.proc.proc.wait(timeout=60)
        assert rc != 0
        out = launcher.proc.output()
        assert "not divisible by the world size (3)" in out, out
        assert "failed to start" in launcher.termination_log.read_text()
    finally:
        launcher.close()

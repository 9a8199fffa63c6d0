"""Quantized checkpoints through the real router and shard, as a TGIS user serves them: a GPTQ
AWQ or fp8 folder as it is (its quantization config is detected), a dense one with
--quantize bitsandbytes. Outputs are transformers' on the dequantized weights
(tests/fixtures/make_quantized_fixtures.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")

CASES = [("llama_gptq4", []), ("llama_gptq8", []), ("llama_awq", []), ("llama_fp8", []),
         ("llama_fp8_fbgemm", ["--quantize", "fp8"]),
         ("llama_int8", ["--quantize", "bitsandbytes"])]


@pytest.mark.parametrize("model,shard_args", CASES, ids=[c[0] for c in CASES])
def test_golden_prompts_in_one_batch(model, shard_args):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer(model, shard_args=shard_args)
    oracle = Oracle(model)
    pb = server.pb
    try:
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        reqs = [pb.GenerationRequest(text=prompt["text"]) for prompt in oracle.prompts]
        got = server.stub.Generate(pb.BatchedGenerationRequest(requests=reqs, params=p),
                                   timeout=60).responses
        for i, (r, prompt) in enumerate(zip(got, oracle.prompts)):
            assert [t.text for t in r.tokens] == oracle.tokens(i, 16), i
            assert [t.logprob for t in r.tokens] == pytest.approx(prompt["logprobs"], abs=1e-3)
    finally:
        server.close()


def _cpu_has_vnni() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"))


INT8_ACTIVATION_CASES = [("llama_gptq4", []), ("llama_int8", ["--quantize", "bitsandbytes"])]


@pytest.mark.parametrize("model,shard_args", INT8_ACTIVATION_CASES,
                         ids=[c[0] for c in INT8_ACTIVATION_CASES])
def test_int8_activations(model, shard_args):
    """CPU_INT8_ACTIVATIONS=true reaches the int8 kernels: the prompts' prefill in one batch
    (more than 16 tokens: the GEMM) for 8- and 4-bit codes, and 4-bit decode (in this fixture
    only down_proj has 128 columns, the chunk that kernel needs). The logprobs move by the
    activations' rounding, and only by a little."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    if not _cpu_has_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU: the mode stays off")
    server = RouterServer(model, shard_args=shard_args + ["--cpu-int8-activations=true"])
    oracle = Oracle(model)
    pb = server.pb
    try:
        assert "int8 activations for 8- and 4-bit weights" in server.shard.output()
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=4),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        reqs = [pb.GenerationRequest(text=prompt["text"]) for prompt in oracle.prompts]
        got = server.stub.Generate(pb.BatchedGenerationRequest(requests=reqs, params=p),
                                   timeout=60).responses
        moved = []
        for i, (r, prompt) in enumerate(zip(got, oracle.prompts)):
            want = prompt["logprobs"][:len(r.tokens)]
            assert [t.text for t in r.tokens][:1] == oracle.tokens(i, 1), i
            moved += [abs(t.logprob - w) for t, w in zip(r.tokens, want)]
        print("logprob moved: max", max(moved), "mean", sum(moved) / len(moved))
        assert max(moved) > 1e-6, "nothing moved: the int8 kernel did not run"
        assert max(moved) < 0.05
    finally:
        server.close()

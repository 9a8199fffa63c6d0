"""Quantized checkpoints through the real router and shard, as a TGIS user serves them: a GPTQ,
AWQ, fp8, compressed-tensors integer or bitsandbytes 8-bit folder as it is (its quantization config
is detected; GPTQModel's per-module `dynamic` rules too), a dense one with --quantize bitsandbytes. Outputs are transformers' on the dequantized weights
(tests/fixtures/make_quantized_fixtures.py)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")

CASES = [("llama_gptq4", []), ("llama_gptq8", []), ("llama_gptq_dynamic", []), ("llama_autoround", []),
         ("llama_awq", []),
         ("llama_fp8", []), ("llama_bnb8", ["--quantize", "bitsandbytes"]),
         ("llama_bnb4", ["--quantize", "bitsandbytes"]), ("llama_bnb4_fp4", []),
         ("llama_fp8_fbgemm", ["--quantize", "fp8"]), ("llama_fp8_block", []), ("llama_ct_w4a16", []),
         ("llama_ct_w8a8", []),
         ("llama_int8", ["--quantize", "bitsandbytes"]),
         ("llama_nf4", ["--quantize", "bitsandbytes-nf4"])]


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


def _cpu_has(*features: str) -> bool:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return all(f in flags for f in features)


def _cpu_is_zen4() -> bool:
    """AMD family 25 (0x19) with AVX-512: Zen 4, where 4-bit codes take the AVX2 panels
    (kernels/cpu/linear.cc, UseAvx512)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return ("AuthenticAMD" in info and re.search(r"^cpu family\s*:\s*25$", info, re.M) is not None
            and _cpu_has("avx512f"))


def _cpu_has_avx2() -> bool:
    """What the int8-activation kernels need (AVX-512 VNNI, where present, only makes them
    faster)."""
    return _cpu_has("avx2", "fma", "f16c")


INT8_ACTIVATION_CASES = [("llama_gptq4", []), ("llama_int8", ["--quantize", "bitsandbytes"])]


@pytest.mark.parametrize("model,shard_args", INT8_ACTIVATION_CASES,
                         ids=[c[0] for c in INT8_ACTIVATION_CASES])
def test_int8_activations(model, shard_args):
    """CPU_INT8_ACTIVATIONS=true gives what transformers gives with each linear's input rounded
    to int8 per 32 stored columns where the server's int8 kernels run (the prompts' prefill in
    one batch: the GEMM, 8- and 4-bit; decode where the width is a multiple of 32 (4-bit) or
    64 (8-bit)), on whichever of the AVX2 and VNNI kernels this CPU runs:
    golden_int8_activations.json, made by tests/fixtures/make_quantized_fixtures.py."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    if not _cpu_has_avx2():
        pytest.skip("no AVX2 on this CPU: the mode stays off")
    server = RouterServer(model, shard_args=shard_args + ["--cpu-int8-activations=true"])
    oracle = Oracle(model)
    golden = json.loads((oracle.model_dir / "golden_int8_activations.json").read_text())["prompts"]
    pb = server.pb
    try:
        assert "int8 activations for 8- and 4-bit weights" in server.shard.output()
        # 4-bit weights get their 8-row panels at load, 8-bit ones too where no VNNI kernel
        # takes them, and the log says what they take; where no AVX-512 kernel reads the rows
        # (no AVX-512; 4-bit codes on Zen 4) every kernel reads the panels and the row-major
        # copy goes.
        out = server.shard.output()
        panels_logged = "4-bit weights' codes interleaved 8 rows at a time take" in out
        vnni = _cpu_has("avx512f", "avx512_vnni")
        assert panels_logged == (model == "llama_gptq4" or not vnni)
        if panels_logged:
            rows_go = not _cpu_has("avx512f") or (model == "llama_gptq4" and _cpu_is_zen4())
            assert ("row-major copy" in out and "were let go" in out) == rows_go
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        reqs = [pb.GenerationRequest(text=prompt["text"]) for prompt in golden]
        got = server.stub.Generate(pb.BatchedGenerationRequest(requests=reqs, params=p),
                                   timeout=60).responses
        # An activation within float rounding of a rounding boundary may land on either int8
        # step here or in torch: such a flip moves a logprob by ~1e-4 to ~3e-2 (seen: 2 of 64
        # logprobs of llama_gptq4, 1.7e-4 and 2.9e-2, the others within 3e-6). Against that,
        # what the rounding moves from the exact goldens is ~50x larger on average.
        off, moved = [], []
        for i, (r, prompt, exact) in enumerate(zip(got, golden, oracle.prompts)):
            want = [oracle.tokenizer.id_to_token(t) for t in prompt["generated_ids"]]
            assert [t.text for t in r.tokens] == want[:len(r.tokens)], i
            lps = [t.logprob for t in r.tokens]
            assert lps == pytest.approx(prompt["logprobs"][:len(lps)], abs=0.1), i
            off += [abs(a - b) for a, b in zip(lps, prompt["logprobs"])]
            if prompt["generated_ids"] == exact["generated_ids"]:
                moved += [abs(a - b) for a, b in zip(prompt["logprobs"], exact["logprobs"])]
        assert sum(d > 1e-2 for d in off) <= 2, sorted(off)[-4:]  # a flip or two, no more
        mean_off, mean_moved = sum(off) / len(off), sum(moved) / max(1, len(moved))
        print(f"logprobs: off the simulation by {mean_off:.2e} on average (max {max(off):.2e}), "
              f"the rounding moves them by {mean_moved:.2e}")
        assert mean_off < 1e-3
        assert mean_moved > 20 * mean_off, "the rounding moves too little to tell the paths apart"
    finally:
        server.close()

"""Prompt tuning (prefix_id) through the real launcher, router and shard, as a TGIS client uses
it: prefixes from PREFIX_STORE_PATH give the greedy ids and logprobs that HF transformers gives
with the prefix prepended through inputs_embeds (tests/fixtures/prefixes/golden.json, made by
make_prefix_fixtures.py); bad prefixes fail with TGIS's messages; tgi_prompt_load_* count."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402

grpc = pytest.importorskip("grpc")
PREFIXES = FIXTURES / "prefixes"
GOLDEN = json.loads((PREFIXES / "golden.json").read_text())
LAUNCHER = "launcher/text-generation-launcher"


@pytest.fixture(scope="module")
def server():
    need_binaries()
    tmp = Path(tempfile.mkdtemp(prefix="tgis-prefix-"))
    grpc_port, http_port = free_port(), free_port()
    env = {"MODEL_NAME": str(FIXTURES / "models" / "llama"), "GRPC_PORT": str(grpc_port),
           "PORT": str(http_port), "SHARD_UDS_PATH": str(tmp / "shard"),
           "TERMINATION_LOG": str(tmp / "termination-log"), "KV_CACHE_BLOCKS": "128",
           "PREFIX_STORE_PATH": str(PREFIXES / "store"), "DTYPE_STR": "float32"}
    proc = Process([binary(LAUNCHER)], env=env)
    try:
        _, pb, stub = wait_serving(proc, grpc_port, timeout=120)
        yield pb, stub, http_port, proc
    finally:
        proc.close()  # closes the channel too
        shutil.rmtree(tmp, ignore_errors=True)


def params(pb, n):
    return pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=n),
                         response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True,
                                                     input_tokens=True))


@pytest.mark.parametrize("prefix_id", sorted(GOLDEN["prefixes"]))
def test_prefix_matches_transformers_inputs_embeds(server, prefix_id):
    pb, stub, _, _ = server
    want = GOLDEN["prefixes"][prefix_id]
    n = GOLDEN["new_tokens"]
    prompts = want["prompts"]
    # All prompts in one batched call (a ragged prefill with two prefixed sequences).
    resp = stub.Generate(pb.BatchedGenerationRequest(
        prefix_id=prefix_id, params=params(pb, n),
        requests=[pb.GenerationRequest(text=p["text"]) for p in prompts]), timeout=60)
    for p, r in zip(prompts, resp.responses):
        # input_token_count is the input's own tokens, as TGIS reports it.
        assert r.input_token_count == len(p["input_ids"])
        assert len(r.input_tokens) == len(p["input_ids"])
        assert r.generated_token_count == n
        got = [t.logprob for t in r.tokens]
        for a, b in zip(got, p["logprobs"]):
            assert abs(a - b) < 1e-4, (got, p["logprobs"])
    # Token ids through the stream of the first prompt (text pieces come from those ids).
    stream = list(stub.GenerateStream(pb.SingleGenerationRequest(
        prefix_id=prefix_id, params=params(pb, n),
        request=pb.GenerationRequest(text=prompts[0]["text"])), timeout=60))
    logprobs = [t.logprob for m in stream for t in m.tokens]
    assert len(logprobs) == n
    for a, b in zip(logprobs, prompts[0]["logprobs"]):
        assert abs(a - b) < 1e-4


def test_prefix_changes_the_output_and_ids_are_the_golden_ones(server):
    pb, stub, _, _ = server
    p = GOLDEN["prefixes"]["llama_pt"]["prompts"][0]
    plain = stub.Generate(pb.BatchedGenerationRequest(
        params=params(pb, GOLDEN["new_tokens"]), requests=[pb.GenerationRequest(text=p["text"])]))
    tuned = stub.Generate(pb.BatchedGenerationRequest(
        prefix_id="llama_pt", params=params(pb, GOLDEN["new_tokens"]),
        requests=[pb.GenerationRequest(text=p["text"])]))
    assert plain.responses[0].text != tuned.responses[0].text
    # The ids HF chose, decoded, are the text we return (a trailing incomplete UTF-8 sequence
    # is held back by the router, as TGIS does).
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(FIXTURES / "models" / "llama" / "tokenizer.json"))
    assert tuned.responses[0].text == tok.decode(p["generated_ids"]).rstrip("\ufffd")


def test_adapter_id_selects_the_prefix_as_the_vllm_tgis_adapter_does(server):
    """adapter_id (field 4, the vllm-tgis-adapter's name for it) selects the prefix, and wins
    over prefix_id when both are set; an empty one leaves prefix_id in charge."""
    pb, stub, _, _ = server
    prefix_id = sorted(GOLDEN["prefixes"])[0]
    p = GOLDEN["prefixes"][prefix_id]["prompts"][0]
    n = GOLDEN["new_tokens"]

    def logprobs(**ids):
        r = stub.Generate(pb.BatchedGenerationRequest(
            params=params(pb, n), requests=[pb.GenerationRequest(text=p["text"])], **ids),
            timeout=60).responses[0]
        return [t.logprob for t in r.tokens]

    for ids in ({"adapter_id": prefix_id}, {"adapter_id": prefix_id, "prefix_id": "missing"},
                {"adapter_id": "", "prefix_id": prefix_id}):
        got = logprobs(**ids)
        assert len(got) == n, ids
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, p["logprobs"])), ids
    stream = list(stub.GenerateStream(pb.SingleGenerationRequest(
        adapter_id=prefix_id, params=params(pb, n), request=pb.GenerationRequest(text=p["text"])),
        timeout=60))
    got = [t.logprob for m in stream for t in m.tokens]
    assert all(abs(a - b) < 1e-4 for a, b in zip(got, p["logprobs"])) and len(got) == n
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.BatchedGenerationRequest(
            adapter_id="missing", requests=[pb.GenerationRequest(text="Hi")]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'missing'" in e.value.details()


@pytest.mark.parametrize("prefix_id,message", [
    ("missing", "can't retrieve prompt prefix with id 'missing': prefix id \"missing\" not found"),
    ("bad_width", "can't retrieve prompt prefix with id 'bad_width': Unexpected <class "
                  "'Exception'>: Prefix embedding tensor dim 32 does not match model (64)"),
    ("bad_rank", "can't retrieve prompt prefix with id 'bad_rank': Unexpected <class "
                 "'Exception'>: Invalid prefix embedding tensor"),
    ("bad_nan", "can't retrieve prompt prefix with id 'bad_nan': Unexpected <class "
                "'Exception'>: Prefix contains non-finite elements"),
    ("../models", "can't retrieve prompt prefix with id '../models': Unexpected <class "
                  "'Exception'>: Invalid prefix id ../models, must contain only alphanumeric, _ "
                  "and - and /"),
    ("a/../../x", "can't retrieve prompt prefix with id 'a/../../x': Unexpected <class "
                  "'Exception'>: Invalid prefix id a/../../x, must contain only alphanumeric, _ "
                  "and - and /"),
    # LoRA adapters we do not serve, or broken ones (ours: TGIS has no LoRA).
    ("lora/bad_dora", "can't retrieve prompt prefix with id 'lora/bad_dora': "
     "lora/bad_dora/adapter_config.json: use_dora is true: DoRA adapters are "
                      "not served"),
    ("lora/bad_lm_head", "can't retrieve prompt prefix with id 'lora/bad_lm_head': "
     "lora/bad_lm_head: modules this model does not adapt: lm_head (LoRA is "
                         "served on model.layers.<layer>.{self_attn.q_proj,self_attn.k_proj,"
                         "self_attn.v_proj,self_attn.o_proj,mlp.gate_proj,mlp.up_proj,"
                         "mlp.down_proj})"),
    ("lora/bad_rank", "can't retrieve prompt prefix with id 'lora/bad_rank': "
     "lora/bad_rank/adapter_model.safetensors: "
                      "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: rank 8, "
                      "adapter_config.json's r is 4"),
    ("lora/bad_half", "can't retrieve prompt prefix with id 'lora/bad_half': "
     "lora/bad_half/adapter_model.safetensors: model.layers.0.self_attn.q_proj "
                      "has lora_A without lora_B"),
    ("lora/bad_shape", "can't retrieve prompt prefix with id 'lora/bad_shape': "
     "lora/bad_shape: model.layers.1.self_attn.q_proj.lora_B is [32, 8], the "
                       "model's is [64, 8]"),
])
def test_bad_prefixes_fail_with_tgis_messages(server, prefix_id, message):
    pb, stub, _, proc = server
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.BatchedGenerationRequest(
            prefix_id=prefix_id, requests=[pb.GenerationRequest(text="Hi")]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == message
    assert proc.alive()


def test_prompt_load_metrics(server):
    pb, stub, http_port, _ = server
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics").read().decode()
    # Each prefix above loaded once (the router caches lengths), each bad one failed.
    loads = [l for l in text.splitlines() if l.startswith("tgi_prompt_load_duration_count ")]
    fails = [l for l in text.splitlines() if l.startswith("tgi_prompt_load_failure ")]
    assert float(loads[0].split()[1]) >= len(GOLDEN["prefixes"])
    assert float(fails[0].split()[1]) >= 6


# LoRA adapters (beyond TGIS, as the vllm-tgis-adapter serves them under adapter_id or
# prefix_id): PREFIX_STORE_PATH/<id>/ holding PEFT's adapter_config.json (peft_type "LORA") and
# adapter_model.safetensors; goldens from PEFT (tests/fixtures/prefixes/lora_golden.json, made
# by make_lora_fixtures.py).
LORA = json.loads((PREFIXES / "lora_golden.json").read_text())
LLAMA_ADAPTERS = sorted(a for a, v in LORA["adapters"].items() if v["model"] == "llama")


@pytest.mark.parametrize("adapter_id", LLAMA_ADAPTERS)
def test_lora_adapter_matches_peft(server, adapter_id):
    pb, stub, _, _ = server
    prompts = LORA["adapters"][adapter_id]["prompts"]
    n = LORA["new_tokens"]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(FIXTURES / "models" / "llama" / "tokenizer.json"))
    resp = stub.Generate(pb.BatchedGenerationRequest(
        adapter_id=adapter_id, params=params(pb, n),
        requests=[pb.GenerationRequest(text=p["text"]) for p in prompts]), timeout=60)
    for p, r in zip(prompts, resp.responses):
        assert r.input_token_count == len(p["input_ids"])  # no virtual tokens
        assert r.generated_token_count == n
        assert r.text == tok.decode(p["generated_ids"]).rstrip("\ufffd")
        got = [t.logprob for t in r.tokens]
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, p["logprobs"])), (got, p["logprobs"])
        # Prompt details: the adapter's logprobs of the prompt's tokens (none for the first).
        got = [t.logprob for t in r.input_tokens][1:]
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, p["prompt_logprobs"][1:])), got
    stream = list(stub.GenerateStream(pb.SingleGenerationRequest(
        prefix_id=adapter_id, params=params(pb, n),
        request=pb.GenerationRequest(text=prompts[0]["text"])), timeout=60))
    got = [t.logprob for m in stream for t in m.tokens]
    assert len(got) == n
    assert all(abs(a - b) < 1e-4 for a, b in zip(got, prompts[0]["logprobs"]))


def test_lora_adapters_and_the_base_model_run_concurrently(server):
    """Streams with either adapter and with none, all at once (one continuous batch): each gets
    its own golden tokens."""
    from concurrent.futures import ThreadPoolExecutor
    pb, stub, _, _ = server
    n = LORA["new_tokens"]
    base = LORA["adapters"][LLAMA_ADAPTERS[0]]["prompts"]
    plain = stub.Generate(pb.BatchedGenerationRequest(
        params=params(pb, n), requests=[pb.GenerationRequest(text=p["text"]) for p in base]),
        timeout=60)
    jobs = [(a, p["text"], p["logprobs"]) for a in LLAMA_ADAPTERS
            for p in LORA["adapters"][a]["prompts"]]
    jobs += [("", p["text"], [t.logprob for t in r.tokens]) for p, r in zip(base, plain.responses)]
    # The adapters do change the output.
    assert jobs[-2][2] != jobs[0][2]

    def run(job):
        adapter_id, text, _ = job
        stream = stub.GenerateStream(pb.SingleGenerationRequest(
            adapter_id=adapter_id, params=params(pb, n), request=pb.GenerationRequest(text=text)),
            timeout=60)
        return [t.logprob for m in stream for t in m.tokens]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs * 2))
    for (adapter_id, _, want), got in zip(jobs * 2, results):
        assert len(got) == n, adapter_id
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, want)), (adapter_id, got, want)


def test_tokenize_looks_the_adapter_up_as_generate_does(server):
    # vllm-tgis-adapter's Tokenize takes adapter_id / prefix_id: a good one tokenizes as the
    # model does, a bad one fails with Generate's message (never ignored).
    pb, stub, _, proc = server
    texts = [pb.TokenizeRequest(text="Hello world, adapters!")]
    plain = stub.Tokenize(pb.BatchedTokenizeRequest(requests=texts, return_tokens=True), timeout=30)
    for kw in ({"adapter_id": LLAMA_ADAPTERS[0]}, {"prefix_id": sorted(GOLDEN["prefixes"])[0]}):
        got = stub.Tokenize(pb.BatchedTokenizeRequest(requests=texts, return_tokens=True, **kw),
                            timeout=30)
        assert got == plain
    for kw in ({"adapter_id": "lora/bad_dora"}, {"prefix_id": "lora/bad_dora"},
               {"adapter_id": "lora/bad_dora", "prefix_id": LLAMA_ADAPTERS[0]}):
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(pb.BatchedTokenizeRequest(requests=texts, **kw), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (
            "can't retrieve prompt prefix with id 'lora/bad_dora': lora/bad_dora/"
            "adapter_config.json: use_dora is true: DoRA adapters are not served")
    assert proc.alive()

"""Encoder-decoder models (T5, FLAN-T5, mT5) through the real launcher (two shards over Gloo)
and router, as a TGIS client sees them: ModelInfo says ENCODER_DECODER; greedy ids (from the
token details) and logprobs are transformers' (tests/fixtures/models/*/golden_seq2seq.json);
the output text is the ids decoded whole; input token details are the encoder's tokens with
NaN logprobs; an echoed input is followed by "\\n\\n" (TGIS's rules for such models)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402

grpc = pytest.importorskip("grpc")
MODELS = sorted(d.name for d in (FIXTURES / "models").iterdir()
                if (d / "golden_seq2seq.json").exists())
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=MODELS)
def served(request):
    need_binaries()
    from tokenizers import Tokenizer

    model = request.param
    model_dir = FIXTURES / "models" / model
    tmp = Path(tempfile.mkdtemp(prefix="tgis-seq2seq-"))
    grpc_port, master_port = free_port(), free_port()
    env = {"MODEL_NAME": str(model_dir), "NUM_SHARD": "2", "GRPC_PORT": str(grpc_port),
           "PORT": str(free_port()), "MASTER_PORT": str(master_port),
           "SHARD_UDS_PATH": str(tmp / "shard"), "TERMINATION_LOG": str(tmp / "termination-log"),
           "KV_CACHE_BLOCKS": "128", "KV_CACHE_BLOCK_SIZE": "4", "DTYPE_STR": "float32"}
    proc = Process([binary("launcher/text-generation-launcher")], env=env)
    try:
        _, pb, stub = wait_serving(proc, grpc_port, timeout=90)
        golden = json.loads((model_dir / "golden_seq2seq.json").read_text())
        yield pb, stub, golden, Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    finally:
        proc.close()  # closes the channel too
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / f"tgis-rendezvous-localhost-{master_port}",
                      ignore_errors=True)


def test_model_info_says_encoder_decoder(served):
    pb, stub, _, _ = served
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.model_kind == pb.ModelInfoResponse.ENCODER_DECODER


def test_greedy_matches_transformers(served):
    pb, stub, golden, tok = served
    prompts = golden["prompts"]
    n = golden["max_new_tokens"]
    eos = tok.token_to_id("</s>")
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=n),
        response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True, input_tokens=True,
                                    input_text=True))
    responses = stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p["text"]) for p in prompts], params=params),
        timeout=60).responses
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = p["generated_ids"]
        # The router stops at EOS (the goldens go on past it).
        want = ids[:ids.index(eos) + 1] if eos in ids else ids
        assert r.input_token_count == len(p["input_ids"]), i
        assert [tok.token_to_id(t.text) for t in r.tokens] == want, f"prompt {i}"
        for k, (t, lp) in enumerate(zip(r.tokens, p["logprobs"])):
            assert abs(t.logprob - lp) <= TOLERANCE, f"prompt {i} step {k}"
        # Input details: the encoder's tokens, no logprobs.
        assert [tok.token_to_id(t.text) for t in r.input_tokens] == p["input_ids"]
        assert all(math.isnan(t.logprob) for t in r.input_tokens)
        # The text: the input, "\n\n", then the output decoded whole.
        assert r.text == p["text"] + "\n\n" + tok.decode(want, skip_special_tokens=True), i


def test_stream_equals_unary(served):
    pb, stub, golden, _ = served
    p = golden["prompts"][2]
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=golden["max_new_tokens"]),
                           response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
    unary = stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p["text"])], params=params), timeout=60).responses[0]
    stream = list(stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=p["text"]), params=params), timeout=60))
    assert "".join(m.text for m in stream) == unary.text
    assert [t.text for m in stream for t in m.tokens] == [t.text for t in unary.tokens]
    assert stream[-1].stop_reason == unary.stop_reason


PREFIX_GOLDEN = json.loads((FIXTURES / "prefixes" / "golden_seq2seq.json").read_text())


@pytest.fixture(scope="module")
def tuned():
    """flan_t5 on two shards with TGIS's prefix store (encoder.pt / decoder.pt prefixes)."""
    need_binaries()
    tmp = Path(tempfile.mkdtemp(prefix="tgis-seq2seq-pt-"))
    grpc_port, master_port = free_port(), free_port()
    env = {"MODEL_NAME": str(FIXTURES / "models" / PREFIX_GOLDEN["model"]), "NUM_SHARD": "2",
           "GRPC_PORT": str(grpc_port), "PORT": str(free_port()), "MASTER_PORT": str(master_port),
           "SHARD_UDS_PATH": str(tmp / "shard"), "TERMINATION_LOG": str(tmp / "termination-log"),
           "KV_CACHE_BLOCKS": "128", "KV_CACHE_BLOCK_SIZE": "4", "DTYPE_STR": "float32",
           "PREFIX_STORE_PATH": str(FIXTURES / "prefixes" / "store")}
    proc = Process([binary("launcher/text-generation-launcher")], env=env)
    try:
        _, pb, stub = wait_serving(proc, grpc_port, timeout=90)
        yield pb, stub
    finally:
        proc.close()  # closes the channel too
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / f"tgis-rendezvous-localhost-{master_port}",
                      ignore_errors=True)


@pytest.mark.parametrize("prefix_id", sorted(PREFIX_GOLDEN["prefixes"]))
def test_prompt_tuning_matches_transformers_inputs_embeds(tuned, prefix_id):
    """Encoder prefix before the input's embeddings, decoder prefix before the decoder start
    token's: transformers with inputs_embeds / decoder_inputs_embeds gives the same ids and
    logprobs (make_seq2seq_prefix_fixtures.py)."""
    pb, stub = tuned
    want = PREFIX_GOLDEN["prefixes"][prefix_id]
    n = PREFIX_GOLDEN["new_tokens"]
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=n),
                           response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True,
                                                       input_tokens=True))
    responses = stub.Generate(pb.BatchedGenerationRequest(
        prefix_id=prefix_id, params=params,
        requests=[pb.GenerationRequest(text=p["text"]) for p in want["prompts"]]),
        timeout=60).responses
    for p, r in zip(want["prompts"], responses):
        assert r.input_token_count == len(p["input_ids"])
        assert len(r.input_tokens) == len(p["input_ids"])  # the input's own tokens only
        got = [t.logprob for t in r.tokens]
        assert len(got) == len(p["generated_ids"]) or got, p["text"]
        for k, (a, b) in enumerate(zip(got, p["logprobs"])):
            assert abs(a - b) <= TOLERANCE, f"{prefix_id} {p['text']!r} step {k}"


def test_odd_prefix_fails_with_tgis_message(tuned):
    pb, stub = tuned
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.BatchedGenerationRequest(
            prefix_id="t5_odd", requests=[pb.GenerationRequest(text="Hi")]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("can't retrieve prompt prefix with id 't5_odd': Unexpected "
                                 "<class 'Exception'>: Encoder/decoder prefix tensor must be of "
                                 "even length")


def test_peft_adapters_are_refused_for_encoder_decoder_models(tuned):
    pb, stub = tuned
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.BatchedGenerationRequest(
            prefix_id="peft/llama_adapter", requests=[pb.GenerationRequest(text="Hi")]),
            timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encoder-decoder architectures not supported for peft models" in e.value.details()

"""Generation through the real router and shard: greedy output against transformers' goldens,
streaming == unary (greedy and seeded sampling) with stop sequences split across tokens, token
details, EOS and min_new_tokens, time limits, truncation."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")


def serve(model: str):
    """The router and shard serving fixture `model`, and transformers' answers for it."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer(model)
    yield server, Oracle(model)
    server.close()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    yield from serve(request.param)


def params(pb, max_new=16, method=None, seed=None, stop=None, include=None, min_new=0,
           tokens=False, logprobs=False, ranks=False, top_n=0, time_limit=0, **decoding):
    p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new, min_new_tokens=min_new,
                                                   stop_sequences=stop or [],
                                                   time_limit_millis=time_limit),
                      response=pb.ResponseOptions(generated_tokens=tokens, token_logprobs=logprobs,
                                                  token_ranks=ranks, top_n_tokens=top_n))
    if include is not None:
        p.stopping.include_stop_sequence = include
    if method == "sample":
        p.method = pb.SAMPLE
        p.sampling.top_k = 50
        if seed is not None:
            p.sampling.seed = seed
    if decoding:
        p.decoding.repetition_penalty = decoding.get("repetition_penalty", 0)
        if "length_penalty" in decoding:
            start, decay = decoding["length_penalty"]
            p.decoding.length_penalty.start_index = start
            p.decoding.length_penalty.decay_factor = decay
    return p


def generate(server, text, p):
    pb = server.pb
    return server.stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)], params=p), timeout=60).responses[0]


def stream(server, text, p):
    pb = server.pb
    return list(server.stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text), params=p), timeout=60))


def assert_stream_equals_unary(messages, unary):
    text = "".join(m.text for m in messages)
    tokens = [(t.text, round(t.logprob, 4)) for m in messages for t in m.tokens]
    last = messages[-1]
    assert text == unary.text
    assert tokens == [(t.text, round(t.logprob, 4)) for t in unary.tokens]
    assert last.generated_token_count == unary.generated_token_count
    assert last.stop_reason == unary.stop_reason
    assert last.stop_sequence == unary.stop_sequence
    assert last.seed == unary.seed == messages[0].seed
    assert messages[0].input_token_count == unary.input_token_count
    assert all(m.stop_reason == 0 for m in messages[:-1])


# Families whose other behaviour is the Llama layout's (tested above with llama): their
# greedy output through the router is what is theirs to check.
@pytest.fixture(scope="module", params=["granite", "phi", "phi3", "gemma", "gemma2",
                                        "gemma3_text", "gemma3", "mistral3", "stablelm", "starcoder2", "cohere", "olmo", "olmo2", "qwen3",
                                        "mixtral", "granitemoe", "granitemoeshared", "granite4_micro",
                                        "granite4_nope", "granite4_h", "qwen2_moe", "qwen3_moe",
                                        "gpt_oss", "gpt_oss_mxfp4"])
def family(request):
    yield from serve(request.param)


def test_greedy_matches_transformers(setup):
    check_greedy(*setup)


def test_greedy_of_other_llama_layout_families_matches_transformers(family):
    """Granite, Phi-2, Phi-3, Gemma, Gemma 2, StableLM, StarCoder2, Cohere, OLMo, Granite 4.0's
    attention-only layouts and the mixtures of experts (Mixtral, GraniteMoE, GraniteMoeShared,
    Qwen2-MoE, gpt-oss dense and with MXFP4 experts)."""
    check_greedy(*family)


def check_greedy(server, oracle):
    pb = server.pb
    # All golden prompts in one batched call: each is its own request, answered in order.
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=p["text"]) for p in oracle.prompts],
        params=params(pb, tokens=True, logprobs=True, ranks=True))
    responses = server.stub.Generate(request, timeout=60).responses
    assert len(responses) == len(oracle.prompts)
    for i, (p, r) in enumerate(zip(oracle.prompts, responses)):
        assert r.input_token_count == len(p["input_ids"])
        assert r.generated_token_count == 16
        assert r.stop_reason == pb.MAX_TOKENS
        assert [t.text for t in r.tokens] == oracle.tokens(i, 16)
        assert r.text == oracle.text(i, 16)
        assert all(t.rank == 1 for t in r.tokens)
        assert [t.logprob for t in r.tokens] == pytest.approx(p["logprobs"], abs=1e-3)


def boundary_stop_sequences(pieces, full):
    """Stop sequences made of the end of one token's text and the start of the next one's,
    whose first occurrence in the output is that boundary: (sequence, its start, tokens)."""
    found, offset = [], 0
    for k in range(len(pieces) - 1):
        offset += len(pieces[k])
        a, b = pieces[k], pieces[k + 1]
        if len(a) < 1 or len(b) < 1:
            continue
        s = a[-2:] + b[:2]
        start = offset - len(a[-2:])
        if full.find(s) == start:
            found.append((s, start, k + 2))
    return found


@pytest.mark.parametrize("method,seed", [("greedy", None), ("sample", 7), ("sample", 123456)])
def test_stream_equals_unary_with_stop_sequences_across_tokens(setup, method, seed):
    server, oracle = setup
    pb = server.pb
    for prompt in (oracle.prompts[1]["text"], oracle.prompts[3]["text"]):
        base = params(pb, method=method, seed=seed, tokens=True, logprobs=True)
        unary = generate(server, prompt, base)
        messages = stream(server, prompt, base)
        assert_stream_equals_unary(messages, unary)
        pieces = [m.text for m in messages[1:]]
        assert len(pieces) == unary.generated_token_count
        cases = boundary_stop_sequences(pieces, unary.text)
        assert cases, f"no usable token boundary in {pieces}"
        for s, start, count in cases[:3]:
            for include in (True, False):
                p = params(pb, method=method, seed=seed, stop=["never seen", s], include=include,
                           tokens=True, logprobs=True)
                u = generate(server, prompt, p)
                assert u.stop_reason == pb.STOP_SEQUENCE, (s, u)
                assert u.stop_sequence == s
                assert u.generated_token_count == count
                assert u.text == unary.text[:start + (len(s) if include else 0)]
                assert_stream_equals_unary(stream(server, prompt, p), u)


def test_seeded_sampling_is_reproducible_and_returns_the_seed(setup):
    server, oracle = setup
    pb = server.pb
    p = params(pb, method="sample", seed=42)
    a = generate(server, oracle.prompts[2]["text"], p)
    b = generate(server, oracle.prompts[2]["text"], p)
    assert a.seed == b.seed == 42
    assert a.text == b.text
    unseeded = generate(server, oracle.prompts[2]["text"], params(pb, method="sample"))
    assert 0 < unseeded.seed < 2**32
    # Its seed reproduces it.
    again = generate(server, oracle.prompts[2]["text"], params(pb, method="sample", seed=unseeded.seed))
    assert again.text == unseeded.text


def test_top_n_tokens(setup):
    server, oracle = setup
    pb = server.pb
    r = generate(server, oracle.prompts[1]["text"], params(pb, max_new=4, tokens=True, logprobs=True,
                                                           top_n=3))
    for t in r.tokens:
        assert len(t.top_tokens) >= 3
        assert t.top_tokens[0].text == t.text  # greedy: the chosen token is the most likely
        assert t.top_tokens[0].logprob == pytest.approx(t.logprob)
        lps = [x.logprob for x in t.top_tokens]
        assert lps == sorted(lps, reverse=True)
    r = generate(server, oracle.prompts[1]["text"], params(pb, max_new=2, tokens=True, top_n=9))
    assert all(5 <= len(t.top_tokens) for t in r.tokens)
    assert all(len(t.top_tokens) == 5 or t.top_tokens[4].logprob == t.top_tokens[5].logprob
               for t in r.tokens)


def test_eos_respects_min_new_tokens(setup):
    server, oracle = setup
    pb = server.pb
    # A strong length penalty (TGIS applies it only with a repetition penalty) makes EOS likely.
    push = {"repetition_penalty": 1.01, "length_penalty": (0, 10.0)}
    prompt = oracle.prompts[2]["text"]
    r = generate(server, prompt, params(pb, tokens=True, **push))
    assert r.stop_reason == pb.EOS_TOKEN
    eos_at = r.generated_token_count
    eos_text = oracle.tokenizer.id_to_token(oracle.eos_ids[0])
    assert r.tokens[-1].text in {oracle.tokenizer.id_to_token(i) for i in oracle.eos_ids}
    assert eos_text not in r.text  # special tokens are not in the text
    later = generate(server, prompt, params(pb, min_new=eos_at + 2, tokens=True, **push))
    assert later.generated_token_count >= eos_at + 2
    assert later.stop_reason in (pb.EOS_TOKEN, pb.MAX_TOKENS)
    assert_stream_equals_unary(stream(server, prompt, params(pb, tokens=True, **push)), r)


def test_time_limit(setup):
    server, oracle = setup
    pb = server.pb
    # 5 ms: far less than 240 tokens take (a queued request may even expire before it starts).
    p = params(pb, max_new=240, time_limit=5)
    r = generate(server, oracle.prompts[1]["text"], p)
    assert r.stop_reason == pb.TIME_LIMIT
    assert r.generated_token_count < 240
    messages = stream(server, oracle.prompts[1]["text"], p)
    assert messages[-1].stop_reason == pb.TIME_LIMIT
    assert messages[-1].generated_token_count < 240


def test_truncation_keeps_the_last_tokens(setup):
    server, oracle = setup
    pb = server.pb
    text = oracle.prompts[3]["text"]
    p = params(pb, max_new=2)
    p.truncate_input_tokens = 6
    p.response.input_tokens = True
    p.response.input_text = True
    r = generate(server, text, p)
    assert r.input_token_count == 6
    assert r.text.startswith(text)  # the input text is the whole text, as TGIS
    full = oracle.tokenizer.encode(text)
    special = oracle.tokenizer.encode(text, add_special_tokens=False)
    kept = full.tokens[:len(full.tokens) - len(special.tokens)]  # the added BOS, if any
    kept = kept + special.tokens[-(6 - len(kept)):]
    assert [t.text for t in r.input_tokens] == kept
    # Tokenize truncates differently in TGIS: the plain tail, a leading BOS cut like the rest.
    tokenized = server.stub.Tokenize(pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=text)], return_tokens=True, truncate_input_tokens=6))
    assert list(tokenized.responses[0].tokens) == full.tokens[-6:]

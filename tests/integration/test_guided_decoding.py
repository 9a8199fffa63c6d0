"""Guided decoding (vllm-tgis-adapter's DecodingParameters.regex / .choice) through the real
launcher, router and shard, as a client of that API uses it: greedy outputs are HF
transformers' greedy choice under an independent oracle (Python's `regex` deciding which
tokens can still lead to a match; tests/fixtures/guided/golden.json, made by
make_guided_golden.py), ids, logprobs, text and stop reason; sampled outputs match the pattern;
json_schema and format JSON outputs parse as JSON and satisfy the schema; a GBNF grammar gives
its regex's output; what is not served (recursive grammars, non-regular patterns, schema
keywords not enforced) is refused by name, never ignored."""

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
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402

grpc = pytest.importorskip("grpc")
GOLDEN = json.loads((FIXTURES / "guided" / "golden.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
LAUNCHER = "launcher/text-generation-launcher"


def launch(num_shard):
    need_binaries()
    tmp = Path(tempfile.mkdtemp(prefix="tgis-guided-"))
    grpc_port, http_port = free_port(), free_port()
    env = {"MODEL_NAME": str(FIXTURES / "models" / "llama"), "GRPC_PORT": str(grpc_port),
           "PORT": str(http_port), "SHARD_UDS_PATH": str(tmp / "shard"),
           "TERMINATION_LOG": str(tmp / "termination-log"), "KV_CACHE_BLOCKS": "128",
           "DTYPE_STR": "float32", "NUM_SHARD": str(num_shard)}
    proc = Process([binary(LAUNCHER)], env=env)
    try:
        _, pb, stub = wait_serving(proc, grpc_port, timeout=120)
        yield pb, stub
    finally:
        proc.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    yield from launch(1)


def test_tensor_parallel_shards_follow_the_same_pattern():
    # Two shards each mask and choose (the same tokens: every rank samples the same logits).
    for pb, stub in launch(2):
        for name in ("phone", "choice", "date"):
            case = CASES[name]
            r = stub.Generate(pb.BatchedGenerationRequest(
                params=params(pb, case), requests=[pb.GenerationRequest(text=case["prompt"])]),
                timeout=60).responses[0]
            check(pb, case, r.text, r.stop_reason, r.generated_token_count,
                  [t.logprob for t in r.tokens])


def decoding(pb, case):
    if "regex" in case:
        return pb.DecodingParameters(regex=case["regex"])
    return pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=case["choice"]))


def params(pb, case, n=None, **kw):
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=n or GOLDEN["max_new_tokens"]),
        response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True),
        decoding=decoding(pb, case), **kw)


def check(pb, case, text, stop_reason, count, logprobs):
    assert text == case["text"]
    assert pb.StopReason.Name(stop_reason) == case["stop_reason"]
    assert count == len(case["generated_ids"])
    assert len(logprobs) == len(case["logprobs"])
    for a, b in zip(logprobs, case["logprobs"]):
        assert abs(a - b) < 1e-4, (logprobs, case["logprobs"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_the_oracle(server, name):
    pb, stub = server
    case = CASES[name]
    r = stub.Generate(pb.BatchedGenerationRequest(
        params=params(pb, case), requests=[pb.GenerationRequest(text=case["prompt"])]),
        timeout=60).responses[0]
    check(pb, case, r.text, r.stop_reason, r.generated_token_count, [t.logprob for t in r.tokens])


def test_streamed_like_batched(server):
    pb, stub = server
    case = CASES["date"]
    msgs = list(stub.GenerateStream(pb.SingleGenerationRequest(
        params=params(pb, case), request=pb.GenerationRequest(text=case["prompt"])), timeout=60))
    check(pb, case, "".join(m.text for m in msgs), msgs[-1].stop_reason,
          msgs[-1].generated_token_count, [t.logprob for m in msgs for t in m.tokens])


def test_guided_and_free_requests_share_batches(server):
    # Every case twice and unconstrained requests, all at once: each guided one its golden.
    pb, stub = server
    results, errors = {}, []

    def run(key, case):
        try:
            if case is None:
                p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16))
                stub.Generate(pb.BatchedGenerationRequest(
                    params=p, requests=[pb.GenerationRequest(text="free text")]), timeout=120)
                return
            r = stub.Generate(pb.BatchedGenerationRequest(
                params=params(pb, case), requests=[pb.GenerationRequest(text=case["prompt"])]),
                timeout=120).responses[0]
            results[key] = (case, r)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=((n, k), CASES[n]))
               for n in CASES for k in range(2)]
    threads += [threading.Thread(target=run, args=(("free", k), None)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2 * len(CASES)
    for case, r in results.values():
        check(pb, case, r.text, r.stop_reason, r.generated_token_count,
              [t.logprob for t in r.tokens])


def test_a_batch_of_inputs_shares_the_pattern(server):
    pb, stub = server
    case = CASES["phone"]
    resp = stub.Generate(pb.BatchedGenerationRequest(
        params=params(pb, case), requests=[pb.GenerationRequest(text=case["prompt"]),
                                           pb.GenerationRequest(text="Another prompt here")]),
        timeout=60)
    check(pb, case, resp.responses[0].text, resp.responses[0].stop_reason,
          resp.responses[0].generated_token_count, [t.logprob for t in resp.responses[0].tokens])
    assert re.fullmatch(case["regex"], resp.responses[1].text)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sampled_outputs_follow_the_pattern(server, seed):
    pb, stub = server
    pattern = r"(cat|dog|bird)s? (eat|see)s? [0-9]{1,3} (apples|fish)\."
    p = pb.Parameters(
        method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=1.5, seed=seed, top_k=50),
        stopping=pb.StoppingCriteria(max_new_tokens=40),
        decoding=pb.DecodingParameters(regex=pattern, repetition_penalty=1.3))
    r = stub.Generate(pb.BatchedGenerationRequest(
        params=p, requests=[pb.GenerationRequest(text="Once upon a time")]), timeout=60).responses[0]
    assert pb.StopReason.Name(r.stop_reason) == "EOS_TOKEN", r
    assert re.fullmatch(pattern, r.text), r.text


def test_min_new_tokens_yields_to_a_complete_choice(server):
    # A choice that is complete can only end: min_new_tokens does not hold it open.
    pb, stub = server
    case = CASES["choice"]
    p = params(pb, case)
    p.stopping.min_new_tokens = 10
    r = stub.Generate(pb.BatchedGenerationRequest(
        params=p, requests=[pb.GenerationRequest(text=case["prompt"])]), timeout=60).responses[0]
    assert r.text in case["choice"]
    assert pb.StopReason.Name(r.stop_reason) == "EOS_TOKEN"


def test_format_text_is_no_constraint(server):
    pb, stub = server
    base = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=8))
    text = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=8),
                         decoding=pb.DecodingParameters(format=pb.DecodingParameters.TEXT))
    a, b = (stub.Generate(pb.BatchedGenerationRequest(
        params=p, requests=[pb.GenerationRequest(text="Hello")]), timeout=60).responses[0].text
        for p in (base, text))
    assert a == b


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"enum": [1, 2, 3]},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
          "required": ["name", "ok", "n"]}


def check_person(obj):
    assert list(obj)[:3] == ["name", "ok", "n"] and set(obj) <= set(PERSON["properties"])
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)
    assert all(t in ("x", "y") for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 2


@pytest.mark.parametrize("method, seed", [("GREEDY", None), ("SAMPLE", 1), ("SAMPLE", 2),
                                          ("SAMPLE", 3)])
def test_json_schema_outputs_satisfy_the_schema(server, method, seed):
    pb, stub = server
    p = pb.Parameters(method=getattr(pb, method),
                      stopping=pb.StoppingCriteria(max_new_tokens=80),
                      decoding=pb.DecodingParameters(json_schema=json.dumps(PERSON)))
    if seed is not None:
        p.sampling.seed = seed
        p.sampling.temperature = 1.2
    r = stub.Generate(pb.BatchedGenerationRequest(
        params=p, requests=[pb.GenerationRequest(text="Describe a person as JSON:")]),
        timeout=60).responses[0]
    assert pb.StopReason.Name(r.stop_reason) == "EOS_TOKEN", r
    check_person(json.loads(r.text))


def test_a_grammar_is_the_same_language_as_its_regex(server):
    # A GBNF grammar of the phone case's language: the same automaton, so the same output.
    pb, stub = server
    case = CASES["phone"]
    p = params(pb, case)
    p.decoding.grammar = 'root ::= digit{3} "-" digit{4}  # as [0-9]{3}-[0-9]{4}\ndigit ::= [0-9]'
    r = stub.Generate(pb.BatchedGenerationRequest(
        params=p, requests=[pb.GenerationRequest(text=case["prompt"])]), timeout=60).responses[0]
    check(pb, case, r.text, r.stop_reason, r.generated_token_count, [t.logprob for t in r.tokens])


def test_format_json_outputs_an_object(server):
    pb, stub = server
    for seed in (1, 2, 3, 4, 5, 6):
        p = pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(seed=seed),
                          stopping=pb.StoppingCriteria(max_new_tokens=60),
                          decoding=pb.DecodingParameters(format=pb.DecodingParameters.JSON))
        r = stub.Generate(pb.BatchedGenerationRequest(
            params=p, requests=[pb.GenerationRequest(text="JSON:")]), timeout=60).responses[0]
        assert r.text.startswith("{"), r.text
        if pb.StopReason.Name(r.stop_reason) == "EOS_TOKEN":
            assert isinstance(json.loads(r.text), dict), r.text


@pytest.mark.parametrize("decoding_kw, code, message", [
    ({"regex": "a(b"}, "INVALID_ARGUMENT",
     "guided decoding: regex: missing ), unterminated subpattern at position 1"),
    ({"regex": r"(a)\1"}, "INVALID_ARGUMENT",
     "guided decoding: regex: a backreference (at position 3) cannot be used in guided decoding"),
    ({"regex": "(?=a)a"}, "INVALID_ARGUMENT",
     "guided decoding: regex: a lookaround assertion (at position 0) cannot be used in guided "
     "decoding"),
    ({"regex": "(a|b)*a(a|b){20}"}, "INVALID_ARGUMENT",
     "guided decoding: regex: the pattern is too complex for guided decoding (more than 20000 "
     "automaton states)"),
    ({"choice": ["only one"]}, "INVALID_ARGUMENT", "Must provide at least two choices"),
    ({"json_schema": '{"type": "integer", "minimum": 3}'}, "UNIMPLEMENTED",
     "guided decoding: json_schema at #: the keyword \"minimum\" is not supported by this "
     "server's guided decoding"),
    ({"json_schema": '{"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}'},
     "INVALID_ARGUMENT", "guided decoding: json_schema at #/properties/a: $ref #/$defs/x is not "
     "found"),
    ({"json_schema": '{"type": '}, "INVALID_ARGUMENT",
     "guided decoding: json_schema is not valid JSON"),
    ({"grammar": 'root ::= "(" root ")" | "x"'}, "UNIMPLEMENTED",
     "guided decoding: grammar: rule root is recursive other than at its end; only grammars of "
     "regular languages are served"),
    ({"grammar": 'root ::= digit\ndigit ::= [0-9'}, "INVALID_ARGUMENT",
     "guided decoding: grammar: unterminated character class at line 2 column 11"),
])
def test_what_is_not_served_is_refused_by_name(server, decoding_kw, code, message):
    pb, stub = server
    if "choice" in decoding_kw:
        decoding_kw = {"choice": pb.DecodingParameters.StringChoices(choices=decoding_kw["choice"])}
    p = pb.Parameters(decoding=pb.DecodingParameters(**decoding_kw))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.BatchedGenerationRequest(
            params=p, requests=[pb.GenerationRequest(text="x")]), timeout=60)
    assert e.value.code().name == code
    assert e.value.details() == message
    # The server goes on.
    ok = stub.Generate(pb.BatchedGenerationRequest(
        params=params(pb, CASES["phone"]), requests=[pb.GenerationRequest(text="Call me at")]),
        timeout=60).responses[0]
    assert ok.text == CASES["phone"]["text"]

"""The YAML cases of router_cases.yaml against a real router and shard (llama fixture), unary and
replayed as streams, plus TGIS's multi-input seed check."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_harness import Oracle, RouterServer, binaries_missing  # noqa: E402

grpc = pytest.importorskip("grpc")
yaml = pytest.importorskip("yaml")
from google.protobuf import json_format  # noqa: E402

CASES_FILE = Path(__file__).with_name("router_cases.yaml")
LOGPROB_TOLERANCE = 1e-3


# --- The YAML tags: markers resolved against the oracle ----------------------------------------

class _Tag:
    def __init__(self, value):
        self.value = value


class Prompt(_Tag): pass
class GoldenText(_Tag): pass
class GoldenTokens(_Tag): pass
class InputTokens(_Tag): pass
class Repeat(_Tag): pass


class CaseLoader(yaml.SafeLoader):
    pass


for _tag, _cls in {"!prompt": Prompt, "!golden_text": GoldenText, "!golden_tokens": GoldenTokens,
                   "!input_tokens": InputTokens, "!repeat": Repeat}.items():
    def _construct(loader, node, cls=_cls):
        if isinstance(node, yaml.ScalarNode):
            return cls(loader.construct_scalar(node))
        return cls(loader.construct_mapping(node, deep=True))
    CaseLoader.add_constructor(_tag, _construct)


def resolve(value, oracle: Oracle):
    if isinstance(value, dict):
        return {k: resolve(v, oracle) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, oracle) for v in value]
    if isinstance(value, Prompt):
        return oracle.prompts[int(value.value)]["text"]
    if isinstance(value, Repeat):
        return value.value["s"] * int(value.value["n"])
    if isinstance(value, GoldenText):
        v = value.value
        text = oracle.text(v["prompt"], v["n"])
        return (oracle.prompts[v["prompt"]]["text"] + text) if v.get("input_text") else text
    if isinstance(value, GoldenTokens):
        v = value.value
        p = oracle.prompts[v["prompt"]]
        tokens = []
        for i, text in enumerate(oracle.tokens(v["prompt"], v["n"])):
            t = {"text": text}
            if v.get("logprobs"):
                t["logprob"] = p["logprobs"][i]
            if v.get("ranks"):
                t["rank"] = 1  # greedy: the most likely token
            tokens.append(t)
        return tokens
    if isinstance(value, InputTokens):
        v = value.value
        p = oracle.prompts[v["prompt"]]
        tokens = []
        for i, token_id in enumerate(p["input_ids"]):
            t = {"text": oracle.tokenizer.id_to_token(token_id)}
            if v.get("logprobs"):
                t["logprob"] = "NaN" if i == 0 else p["prompt_logprobs"][i]
            tokens.append(t)
        return tokens
    return value


def load_cases():
    return yaml.load(CASES_FILE.read_text(), Loader=CaseLoader)


# --- Comparison -----------------------------------------------------------------------------------

def mismatches(actual, expected, partial: bool, path: str = "") -> list[str]:
    """Differences between a response (as protobuf JSON) and what the case expects."""
    out = []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"]
        keys = expected.keys() if partial else set(expected) | set(actual)
        for k in keys:
            if k not in actual:
                out.append(f"{path}.{k}: missing (expected {expected[k]!r})")
            elif k not in expected:
                out.append(f"{path}.{k}: unexpected {actual[k]!r}")
            else:
                out += mismatches(actual[k], expected[k], partial, f"{path}.{k}")
        return out
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{path}: expected {len(expected)} items, got {actual!r}"]
        for i, (a, e) in enumerate(zip(actual, expected)):
            out += mismatches(a, e, partial, f"{path}[{i}]")
        return out
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isclose(actual, expected, abs_tol=LOGPROB_TOLERANCE):
            return []
    elif actual == expected:
        return []
    return [f"{path}: expected {expected!r}, got {actual!r}"]


def to_dict(message) -> dict:
    return json_format.MessageToDict(message)


# --- Running a case ---------------------------------------------------------------------------------

def run_unary(server: RouterServer, case: dict):
    pb = server.pb
    request = json_format.ParseDict(case["request"], pb.BatchedGenerationRequest())
    try:
        response = server.stub.Generate(request, timeout=60)
    except grpc.RpcError as e:
        assert "error" in case, f"unexpected error {e.code().name}: {e.details()}"
        assert e.code().name == case["error"]["code"]
        assert e.details() == case["error"]["message"]
        return None
    assert "error" not in case, f"expected {case['error']}, got a response"
    got = to_dict(response)
    diff = mismatches(got, case["response"], case.get("partial", False))
    assert not diff, "\n".join(diff) + f"\nresponse: {got}"
    return got


def run_stream(server: RouterServer, case: dict, unary: dict | None):
    """Replays a single-input case as a stream; checks TGIS's streaming shape and, unless the
    case is random, that the stream adds up to the unary response."""
    pb = server.pb
    request = dict(case["request"])
    request["request"] = request.pop("requests")[0]
    params = request.get("params", {})
    options = params.get("response", {})
    message = json_format.ParseDict(request, pb.SingleGenerationRequest())
    try:
        messages = [to_dict(m) for m in server.stub.GenerateStream(message, timeout=60)]
    except grpc.RpcError as e:
        assert "error" in case, f"unexpected stream error {e.code().name}: {e.details()}"
        assert e.code().name == case["error"]["code"]
        assert e.details() == case["error"]["message"]
        return
    assert "error" not in case, "the stream should have failed"
    assert unary is not None
    expected = unary["responses"][0]

    first = messages.pop(0)
    assert first.get("inputTokenCount") == expected["inputTokenCount"]
    assert "generatedTokenCount" not in first and "stopReason" not in first
    if options.get("inputText"):
        assert first["text"] == request["request"]["text"]
    else:
        assert "text" not in first
    sampling = params.get("method") == "SAMPLE"
    assert ("seed" in first) == sampling
    text = first.get("text", "")

    if options.get("inputTokens"):
        second = messages.pop(0)
        assert set(second) <= {"inputTokens", "inputTokenCount"}, second
        assert not mismatches(second["inputTokens"], expected["inputTokens"], False)

    tokens, count, last = [], 0, None
    for i, m in enumerate(messages):
        is_last = i == len(messages) - 1
        assert "inputTokenCount" not in m and "inputTokens" not in m
        assert ("stopReason" in m) == is_last, f"stop reason placement: {m}"
        if not is_last:
            assert "seed" not in m
        c = m.get("generatedTokenCount", 0)
        assert c > count or (c == 0 and is_last), f"counts must grow: {count} then {m}"
        count = c
        text += m.get("text", "")
        tokens += m.get("tokens", [])
        last = m
    assert last is not None, "the stream sent no generation message"
    assert ("seed" in last) == sampling
    if case.get("random"):
        return
    assert text == expected.get("text", "")
    assert count == expected.get("generatedTokenCount", 0)
    assert last["stopReason"] == expected["stopReason"]
    assert last.get("stopSequence") == expected.get("stopSequence")
    assert last.get("seed") == expected.get("seed") == first.get("seed")
    assert not mismatches(tokens, expected.get("tokens", []), False)


# --- Tests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    # The limits come through the environment, as TGIS's launcher passes them.
    s = RouterServer("llama", env={"MAX_SEQUENCE_LENGTH": "48", "MAX_NEW_TOKENS": "20",
                                   "MAX_BATCH_SIZE": "8"})
    yield s
    s.close()


@pytest.fixture(scope="module")
def oracle():
    return Oracle("llama")


CASES = load_cases()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case(server, oracle, case):
    case = resolve(case, oracle)
    unary = run_unary(server, case)
    requests = case["request"].get("requests", [])
    if len(requests) == 1:
        run_stream(server, case, unary)


def test_identical_sampled_inputs_get_distinct_seeds_and_texts(server):
    # As TGIS's seed test: the same input five times in one sampling request.
    pb = server.pb
    request = json_format.ParseDict({
        "params": {"method": "SAMPLE", "sampling": {"topK": 20}, "stopping": {"maxNewTokens": 8}},
        "requests": [{"text": "The same input multiple times:\n"}] * 5,
    }, pb.BatchedGenerationRequest())
    responses = server.stub.Generate(request, timeout=60).responses
    seeds = {r.seed for r in responses}
    texts = {r.text for r in responses}
    assert len(seeds) == 5 and len(texts) == 5
    assert all(0 <= s < 2**32 for s in seeds)

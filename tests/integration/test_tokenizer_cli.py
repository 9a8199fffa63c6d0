"""Direct checks of the tgis-tokenizer command-line tool's line protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_cli  # noqa: E402
from tokenizer_cli import FIXTURES  # noqa: E402

pytest.importorskip("tokenizers")
pytest.importorskip("sentencepiece")
from tokenizer_reference import load_reference  # noqa: E402


@pytest.fixture(scope="module")
def cli():
    if not tokenizer_cli.cli_available():
        pytest.skip(tokenizer_cli.skip_reason())
    return tokenizer_cli


@pytest.mark.parametrize("family", ["gpt2", "llama2", "llama_spm"])
def test_invalid_utf8_line_is_an_error_and_later_lines_still_work(cli, family):
    d = FIXTURES / family
    ref = load_reference(d)
    lines = [json.dumps("hello world"), '"\\ud800"', '"a\\udc00b"', json.dumps("after 😀 the error")]
    out = cli.run_lines(["encode", str(d)], lines)
    assert "error" in out[1] and "ids" not in out[1], out[1]
    assert "error" in out[2] and "ids" not in out[2], out[2]
    assert out[0]["ids"] == ref.encode("hello world")["ids"]
    assert out[3]["ids"] == ref.encode("after 😀 the error")["ids"]
    assert out[3]["offsets"] == ref.encode("after 😀 the error")["offsets"]


@pytest.mark.parametrize("family", ["gpt2", "llama2", "llama3", "t5", "t5_spm", "llama_spm",
                                    "gpt_oss"])
def test_empty_inputs(cli, family):
    d = FIXTURES / family
    ref = load_reference(d)
    enc = cli.encode(d, [""])[0]
    assert enc["ids"] == ref.encode("")["ids"]
    assert enc["offsets"] == ref.encode("")["offsets"]
    assert cli.encode(d, [""], add_special_tokens=False)[0]["ids"] == []
    assert cli.decode(d, [[]])[0] == {"text": ""}
    s = cli.stream(d, [[]])[0]
    assert s["text"] == "" and "".join(s["pieces"]) == ""


def test_escaped_newlines_and_many_lines(cli):
    d = FIXTURES / "qwen2"
    ref = load_reference(d)
    texts = [f"line {i}\nwith\r\nnewlines\tand \"quotes\" \\ {i * 7919}" for i in range(500)]
    out = cli.encode(d, texts)
    assert [o["ids"] for o in out] == [ref.encode(t)["ids"] for t in texts]
    dec = cli.decode(d, [o["ids"] for o in out])
    assert [x["text"] for x in dec] == texts


def test_output_is_utf8_not_ascii_escaped(cli):
    d = FIXTURES / "llama3"
    ref = load_reference(d)
    text = "héllo 世界 😀"
    ids = ref.encode(text, False)["ids"]
    proc = subprocess.run([str(cli.cli_path()), "decode", str(d)], input=(json.dumps(ids) + "\n").encode(),
                          stdout=subprocess.PIPE, check=True, timeout=60)
    assert json.loads(proc.stdout.decode("utf-8"))["text"] == text
    assert "世界".encode() in proc.stdout

"""Model folders with GPT-2 style tokenizer files only (vocab.json + merges.txt, no
tokenizer.json: OPT's repositories, older GPT-2 derivatives). TGIS's launcher has transformers
convert them to a fast tokenizer; we convert them in C++. The oracle is that conversion itself:
transformers' AutoTokenizer loading the same folder (GPT2Converter), run here at test time.
Slow files are written by transformers (save_pretrained with legacy_format) from the gpt2
fixture's tokenizer, in GPT-2's, OPT's (a BOS prepended) and RoBERTa-like (add_prefix_space)
configurations."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_cli  # noqa: E402

transformers = pytest.importorskip("transformers")
FIXTURES = tokenizer_cli.FIXTURES
TEXTS = json.loads((FIXTURES / "corpus.json").read_text()) + [
    "<|endoftext|>Hello<|endoftext|> world", " leading space", "trailing space ", "",
    "an <extra_tok> and a spaced word<extra_tok>"]


def slow_folder(tmp_path, name: str, **config) -> str:
    """vocab.json + merges.txt (+ tokenizer_config.json, special_tokens_map.json) as
    transformers' slow GPT2Tokenizer saves them, with `config` merged into tokenizer_config."""
    fast = transformers.GPT2TokenizerFast(tokenizer_file=str(FIXTURES / "gpt2" / "tokenizer.json"),
                                          bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                          unk_token="<|endoftext|>")
    fast.add_tokens(["<extra_tok>", " spaced"])  # saved to added_tokens.json
    out = tmp_path / name
    fast.save_pretrained(str(out), legacy_format=True)
    (out / "tokenizer.json").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config)
    cfg_path.write_text(json.dumps(cfg))
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()
    return str(out)


@pytest.mark.parametrize("name,config", [
    ("gpt2", {}),
    ("opt_like", {"add_bos_token": True}),
    ("prefix_space", {"add_prefix_space": True}),
])
def test_encodes_and_decodes_as_transformers_converts(tmp_path, name, config):
    if not tokenizer_cli.cli_available():
        pytest.skip(tokenizer_cli.skip_reason())
    folder = slow_folder(tmp_path, name, **config)
    assert "<extra_tok>" in json.loads((tmp_path / name / "added_tokens.json").read_text())
    oracle = transformers.AutoTokenizer.from_pretrained(folder)
    assert oracle.is_fast  # converted from the slow files, as TGIS's launcher does
    for special in (True, False):
        ours = tokenizer_cli.encode(folder, TEXTS, add_special_tokens=special)
        for text, got in zip(TEXTS, ours):
            assert got.get("ids") == oracle(text, add_special_tokens=special)["input_ids"], \
                (name, special, text)
    ids = [oracle(t)["input_ids"] for t in TEXTS]
    for skip in (False, True):
        decoded = tokenizer_cli.decode(folder, ids, skip_special_tokens=skip)
        assert [d["text"] for d in decoded] == [
            oracle.decode(i, skip_special_tokens=skip) for i in ids], (name, skip)


def test_other_tokenizer_classes_are_refused_by_name(tmp_path):
    if not tokenizer_cli.cli_available():
        pytest.skip(tokenizer_cli.skip_reason())
    folder = slow_folder(tmp_path, "roberta", tokenizer_class="RobertaTokenizer")
    with pytest.raises(tokenizer_cli.CliError) as e:
        tokenizer_cli.encode(folder, ["hi"])
    assert "RobertaTokenizer" in str(e.value)

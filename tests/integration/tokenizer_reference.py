"""Reference tokenization computed with the Python libraries (the oracle).

Shared by tests/fixtures/make_tokenizer_fixtures.py (golden files) and the
randomized oracle test, so both use the same conventions:

* Model folders with a tokenizer.json are run through HF `tokenizers`.
  Offsets: HF's Python binding reports character (code point) offsets; they
  are converted here to BYTE offsets into the UTF-8 text. A token that covers
  only part of a character (byte-level BPE splitting an emoji, byte-fallback
  tokens) is therefore reported with the span of the whole character, because
  that is all the char offsets carry. Tokens added by the post-processor have
  [0, 0].
* Folders with only a SentencePiece model (tokenizer.model or spiece.model)
  are run through the `sentencepiece` library:
  - ids/pieces/offsets from encode_as_immutable_proto. Its Python wrapper
    reports begin/end in code points (even for bytes input), converted here to
    bytes; they are the C++ library's byte offsets. With byte fallback, the
    byte pieces of one character are [b, b], [b, b], ..., [b, e]: all but the
    last are empty at the character's start, the last spans the character;
  - BOS/EOS added per tokenizer_config.json `add_bos_token` / `add_eos_token`
    (absent = false), with offsets [0, 0];
  - decode(ids, skip_special_tokens=True) == sp.decode(ids) (control pieces
    such as <s> and </s> vanish, <unk> decodes to the unk surface " ⁇ ");
  - decode(ids, skip_special_tokens=False): each maximal run of non-control
    ids is decoded with sp.decode(run), and each control id is written as its
    piece text; e.g. [<s>, "▁Hello"] -> "<s>Hello".
"""

from __future__ import annotations

import json
import os
from itertools import accumulate
from pathlib import Path
from typing import Sequence


def _utf8_len(c: str) -> int:
    o = ord(c)
    return 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4


def char_to_byte_table(text: str) -> list[int]:
    """table[i] = byte offset of code point i; table[len(text)] = byte length."""
    return list(accumulate((_utf8_len(c) for c in text), initial=0))


def model_kind(model_dir: str | os.PathLike) -> str:
    d = Path(model_dir)
    if (d / "tokenizer.json").is_file():
        return "hf"
    if (d / "tokenizer.model").is_file() or (d / "spiece.model").is_file():
        return "spm"
    raise FileNotFoundError(f"no tokenizer.json / tokenizer.model / spiece.model in {d}")


class HFReference:
    kind = "hf"

    def __init__(self, model_dir: str | os.PathLike):
        from tokenizers import Tokenizer

        self.dir = Path(model_dir)
        self.tok = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        self.tok.no_truncation()
        self.tok.no_padding()
        with open(self.dir / "tokenizer.json", encoding="utf-8") as f:
            self.json = json.load(f)

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def added_tokens(self) -> list[str]:
        return [t["content"] for t in self.json.get("added_tokens", [])]

    def special_tokens(self) -> list[str]:
        return [t["content"] for t in self.json.get("added_tokens", []) if t.get("special")]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[dict]:
        encs = self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        out = []
        for text, e in zip(texts, encs):
            tab = char_to_byte_table(text)
            out.append(
                {
                    "ids": list(e.ids),
                    "tokens": list(e.tokens),
                    "offsets": [[tab[s], tab[t]] for s, t in e.offsets],
                }
            )
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> dict:
        return self.encode_batch([text], add_special_tokens)[0]

    def decode_batch(self, ids_list: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.tok.decode_batch([list(x) for x in ids_list], skip_special_tokens=skip_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class SPMReference:
    kind = "spm"

    def __init__(self, model_dir: str | os.PathLike):
        import sentencepiece as spm

        self.dir = Path(model_dir)
        model = self.dir / "tokenizer.model"
        if not model.is_file():
            model = self.dir / "spiece.model"
        self.sp = spm.SentencePieceProcessor(model_file=str(model))
        cfg_path = self.dir / "tokenizer_config.json"
        cfg = {}
        if cfg_path.is_file():
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.add_eos = bool(cfg.get("add_eos_token", False))
        n = self.sp.get_piece_size()
        self._control = [self.sp.is_control(i) for i in range(n)]

    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def special_tokens(self) -> list[str]:
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size())
                if self._control[i] or self.sp.is_unknown(i)]

    def added_tokens(self) -> list[str]:
        return self.special_tokens()

    def encode(self, text: str, add_special_tokens: bool = True) -> dict:
        pieces = self.sp.encode_as_immutable_proto(text).pieces
        ids = [p.id for p in pieces]
        tokens = [p.piece for p in pieces]
        # The Python wrapper reports begin/end in code points; convert to bytes.
        tab = char_to_byte_table(text)
        offsets = [[tab[p.begin], tab[p.end]] for p in pieces]
        if add_special_tokens and self.add_bos and self.sp.bos_id() >= 0:
            b = self.sp.bos_id()
            ids.insert(0, b)
            tokens.insert(0, self.sp.id_to_piece(b))
            offsets.insert(0, [0, 0])
        if add_special_tokens and self.add_eos and self.sp.eos_id() >= 0:
            e = self.sp.eos_id()
            ids.append(e)
            tokens.append(self.sp.id_to_piece(e))
            offsets.append([0, 0])
        return {"ids": ids, "tokens": tokens, "offsets": offsets}

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[dict]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if skip_special_tokens:
            return self.sp.decode(ids)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if 0 <= i < len(self._control) and self._control[i]:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def decode_batch(self, ids_list: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(x, skip_special_tokens) for x in ids_list]


def load_reference(model_dir: str | os.PathLike):
    return HFReference(model_dir) if model_kind(model_dir) == "hf" else SPMReference(model_dir)

"""Randomized comparison of the C++ tokenizer (via the tgis-tokenizer CLI) with the
Python reference libraries (HF tokenizers / sentencepiece), for every fixture model
folder under tests/fixtures/tokenizers/.

Per family: the golden corpus plus N seeded random strings (N from
$TGIS_TOKENIZER_ORACLE_N, default 10000) are encoded with and without special
tokens; the reference ids are decoded and stream-decoded (skip_special_tokens
false and true); and random id sequences (random ids, and slices of real
encodings that start and end mid-character) are decoded and stream-decoded.
Each mode is one CLI process fed all lines on stdin.

Conventions of the reference (byte offsets, spm decode of control tokens):
see tokenizer_reference.py.
"""

from __future__ import annotations

import json
import os
import random
import string
import sys
import zlib
from functools import lru_cache
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_cli  # noqa: E402
from tokenizer_cli import FIXTURES  # noqa: E402

pytest.importorskip("tokenizers")
pytest.importorskip("sentencepiece")
from tokenizer_reference import load_reference  # noqa: E402

N_RANDOM = int(os.environ.get("TGIS_TOKENIZER_ORACLE_N", "10000"))
N_RANDOM_IDS = max(200, N_RANDOM // 5)
MAX_REPORT = 5
FAMILIES = tokenizer_cli.families()

# ----------------------------------------------------------------------------
# Random text
# ----------------------------------------------------------------------------

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have "
         "from or one had by word but not what all were we when your can said there use an each "
         "which she do how their if will up other about out many then them these so some her "
         "would make like him into time has look two more write go see number no way could people "
         "my than first water been call who oil its now find long down day did get come made may "
         "part hello world token server model stream batch def return self class import print "
         "int char void struct const static while for if else elif None True False null").split()
SNIPPETS = [
    "def f(x):\n    return x + 1\n", "if (a && b) {\n\treturn -1;\n}", "for i in range(10):\n\tpass",
    "x = [1, 2, 3]  # list", "#include <stdio.h>\n", "printf(\"%d\\n\", n);", "    else:\n        ",
    "}\n\n", "/* comment */", "// TODO: fix", "std::vector<int> v{1, 2};", "a->b->c", "x += y ** 2",
    "lambda k: k[0]", "    \n    \n", "\t\t\tcase 'x':", "SELECT * FROM t WHERE id = 42;",
    "<div class=\"a\">&amp;</div>", "{\"key\": [true, null]}", "s = f'{x!r:>10}'", "a == b != c",
    "#!/usr/bin/env python3\n", "@decorator\n", "0x7fffffff", "1e-9", "i++;", "::", "...", "=>",
]
PUNCT = list(string.punctuation) + list("…—–“”‘’«»¿¡·•§¶†‡※、。，！？：；「」『』【】؟،۔।")
WS = [" ", " ", " ", " ", "\t", "\n", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\x0b", "\x0c",
      "\u2009", "\u200b", "\u2028", "\u0085"]
RARE = ["\u00a0", "\u3000", "\u200b", "\ufeff", "\u200d", "\u00ad", "\u2060", "\u202f", "\ufffd",
        "\ufffe", "\uffff", "\x00", "\x01", "\x1b", "\x7f", "\x80", "\x9f", "\u2581", "\u0120",
        "\u010a", "\u2047", "ﬁ", "ﬀ", "①", "½", "²", "ℌ", "\u212b", "\u2126", "ẞ", "ß", "İ", "ı",
        "ǅ", "\U0001d400", "\U0001d7d8", "\ue000", "\U000f0000", "\U0010ffff", "\u0340", "\u0958",
        "\uff21", "\uff41", "\uff10", "\u0660", "\u0966", "<0x41>", "<0xE4>", "Ġ", "Ċ", "▁▁"]
SKIN = [chr(c) for c in range(0x1F3FB, 0x1F400)]
EMOJI_BASE = ([chr(c) for c in range(0x1F600, 0x1F650)] + [chr(c) for c in range(0x1F466, 0x1F46A)]
              + ["👍", "👋", "🙏", "✌", "☝", "❤", "⭐", "🚀", "🔥", "🧑", "👩", "👨", "💻", "🌈", "🏳"])


def _script_char(rng: random.Random) -> str:
    ranges = [(0x4E00, 0x9FFF), (0x3041, 0x3096), (0x30A1, 0x30FA), (0xAC00, 0xD7A3),
              (0x0410, 0x044F), (0x0621, 0x064A), (0x0905, 0x0939), (0x0E01, 0x0E2E),
              (0x0391, 0x03C9), (0x05D0, 0x05EA), (0x00C0, 0x00FF), (0x0100, 0x017F)]
    lo, hi = rng.choice(ranges)
    return chr(rng.randint(lo, hi))


def _script_word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:  # CJK run (no spaces)
        return "".join(chr(rng.randint(0x4E00, 0x9FFF)) if rng.random() < 0.7 else
                       chr(rng.randint(0x3041, 0x30FA)) for _ in range(rng.randint(1, 8)))
    if r < 0.45:
        return "".join(chr(rng.randint(0x0410, 0x044F)) for _ in range(rng.randint(1, 9)))
    if r < 0.6:  # Arabic with optional harakat
        return "".join(chr(rng.randint(0x0621, 0x064A)) + (chr(rng.randint(0x064B, 0x0652))
                       if rng.random() < 0.2 else "") for _ in range(rng.randint(1, 7)))
    if r < 0.75:  # Devanagari consonant + vowel sign / virama
        return "".join(chr(rng.randint(0x0915, 0x0939)) + (chr(rng.randint(0x093E, 0x094D))
                       if rng.random() < 0.5 else "") for _ in range(rng.randint(1, 5)))
    if r < 0.85:
        return "".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(rng.randint(1, 5)))
    return "".join(_script_char(rng) for _ in range(rng.randint(1, 6)))


def _emoji(rng: random.Random) -> str:
    r = rng.random()
    e = rng.choice(EMOJI_BASE)
    if r < 0.3:
        return e
    if r < 0.5:
        return e + rng.choice(SKIN)
    if r < 0.75:  # ZWJ sequence, optionally with skin tones and VS16
        parts = [rng.choice(EMOJI_BASE) + (rng.choice(SKIN) if rng.random() < 0.3 else "")
                 for _ in range(rng.randint(2, 4))]
        return "\u200d".join(p + ("\ufe0f" if rng.random() < 0.2 else "") for p in parts)
    if r < 0.85:  # flag
        return chr(rng.randint(0x1F1E6, 0x1F1FF)) + chr(rng.randint(0x1F1E6, 0x1F1FF))
    if r < 0.92:  # keycap
        return rng.choice("0123456789#*") + "\ufe0f\u20e3"
    return e + "\ufe0f"


def _combining(rng: random.Random) -> str:
    base = rng.choice(string.ascii_letters + "ıøæ" + ("" if rng.random() < 0.9 else " "))
    marks = "".join(chr(rng.randint(0x0300, 0x036F)) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.1:  # Hangul jamo that NFC composes
        return chr(rng.randint(0x1100, 0x1112)) + chr(rng.randint(0x1161, 0x1175)) + \
            (chr(rng.randint(0x11A8, 0x11C2)) if rng.random() < 0.5 else "")
    if rng.random() < 0.05:
        return marks  # marks with no base
    return base + marks


def _word(rng: random.Random) -> str:
    w = rng.choice(WORDS) if rng.random() < 0.7 else "".join(
        rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 14)))
    r = rng.random()
    if r < 0.1:
        w = w.upper()
    elif r < 0.25:
        w = w.capitalize()
    if rng.random() < 0.06:
        w += rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "’s", "'x"])
    return w


def _digits(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.8:
        return "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 20)))
    if r < 0.9:
        return f"{rng.randint(0, 10**6)}.{rng.randint(0, 999)}"
    return "".join(rng.choice("٠١٢٣٤٥٦٧٨٩０１２３４５６７８９०१२३½①²") for _ in range(rng.randint(1, 5)))


def _special(rng: random.Random, specials: list[str]) -> str:
    if not specials:
        return _word(rng)
    s = rng.choice(specials)
    r = rng.random()
    if r < 0.6:
        return s
    if r < 0.7:
        return " " + s + " "
    if r < 0.8 and len(s) > 1:
        return s[:rng.randint(1, len(s) - 1)]  # truncated: must not match
    if r < 0.9:
        return s + s
    return s.upper() if rng.random() < 0.5 else "  " + s


def _fragment(rng: random.Random, specials: list[str]) -> str:
    k = rng.random()
    if k < 0.30:
        return _word(rng)
    if k < 0.40:
        return "".join(rng.choice(WS) for _ in range(rng.randint(1, 8)))
    if k < 0.47:
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4)))
    if k < 0.53:
        return _digits(rng)
    if k < 0.60:
        return rng.choice(SNIPPETS)
    if k < 0.70:
        return _script_word(rng)
    if k < 0.77:
        return _emoji(rng)
    if k < 0.82:
        return _combining(rng)
    if k < 0.90:
        return _special(rng, specials)
    if k < 0.96:
        return rng.choice(RARE)
    if k < 0.98:
        return rng.choice("a =-_.\t0") * rng.randint(5, 60)
    return chr(rng.randint(0x20, 0x2FFF))


def random_text(rng: random.Random, specials: list[str]) -> str:
    if rng.random() < 0.02:
        return rng.choice(["", " ", "\n", "  ", "\t"])
    target = rng.choice([rng.randint(1, 8), rng.randint(1, 40), rng.randint(1, 200)])
    parts: list[str] = []
    n = 0
    while n < target:
        f = _fragment(rng, specials)
        if parts and rng.random() < 0.45:
            f = " " + f
        parts.append(f)
        n += len(f)
    s = "".join(parts)
    if len(s) > 220:
        s = s[:rng.randint(180, 220)]
    return s


def family_seed(family: str) -> int:
    return zlib.crc32(family.encode()) ^ 0x5EED


# ----------------------------------------------------------------------------
# Cached per-family data
# ----------------------------------------------------------------------------

@lru_cache(maxsize=None)
def reference(family: str):
    return load_reference(FIXTURES / family)


@lru_cache(maxsize=None)
def texts(family: str) -> tuple[str, ...]:
    ref = reference(family)
    specials = sorted(set(ref.added_tokens()))
    rng = random.Random(family_seed(family))
    corpus = json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8"))
    return tuple(corpus) + tuple(random_text(rng, specials) for _ in range(N_RANDOM))


@lru_cache(maxsize=None)
def ref_encodings(family: str, add_special_tokens: bool):
    return reference(family).encode_batch(list(texts(family)), add_special_tokens)


@lru_cache(maxsize=None)
def random_id_lists(family: str) -> tuple[tuple[int, ...], ...]:
    ref = reference(family)
    rng = random.Random(family_seed(family) + 1)
    n = ref.vocab_size()
    encs = [e["ids"] for e in ref_encodings(family, True) if len(e["ids"]) > 2]
    out = []
    for _ in range(N_RANDOM_IDS):
        r = rng.random()
        if r < 0.5 and encs:  # a slice of a real encoding (may start/end mid-character)
            ids = rng.choice(encs)
            a = rng.randint(0, len(ids) - 1)
            b = rng.randint(a, min(len(ids), a + 40))
            out.append(tuple(ids[a:b]))
        elif r < 0.6:  # low ids: specials, and byte-fallback pieces in the spm families
            out.append(tuple(rng.randint(0, min(n - 1, 300)) for _ in range(rng.randint(0, 12))))
        else:
            out.append(tuple(rng.randrange(n) for _ in range(rng.randint(0, 30))))
    return tuple(out)


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------

def _first_diff(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def fail_report(family: str, what: str, failures: list[str], total: int):
    head = f"[{family}] {what}: {len(failures)} of {total} cases mismatch; first {min(MAX_REPORT, len(failures))}:"
    pytest.fail("\n\n".join([head] + failures[:MAX_REPORT]), pytrace=False)


@pytest.fixture(scope="module")
def cli():
    if not tokenizer_cli.cli_available():
        pytest.skip(tokenizer_cli.skip_reason())
    return tokenizer_cli


params_family = pytest.mark.parametrize("family", FAMILIES)


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------

@params_family
def test_reference_reproduces_golden(family):
    """The installed Python libraries still produce golden.json (no CLI needed)."""
    golden_path = FIXTURES / family / "golden.json"
    if not golden_path.is_file():
        pytest.skip("no golden.json")
    rows = json.loads(golden_path.read_text(encoding="utf-8"))
    ref = reference(family)
    failures = []
    for row in rows:
        e = ref.encode(row["text"], True)
        got = {"ids": e["ids"], "offsets": e["offsets"], "tokens": e["tokens"],
               "ids_no_special": ref.encode(row["text"], False)["ids"],
               "decoded": ref.decode(e["ids"], False), "decoded_skip": ref.decode(e["ids"], True)}
        for k, v in got.items():
            if row[k] != v:
                failures.append(f"text={row['text']!r}\n  {k}: golden={row[k]!r}\n  {k}: now   ={v!r}")
                break
    if failures:
        fail_report(family, "reference libraries vs golden.json (regenerate fixtures?)",
                    failures, len(rows))


@params_family
@pytest.mark.parametrize("add_special_tokens", [True, False], ids=["special", "no_special"])
def test_encode(cli, family, add_special_tokens):
    ts = texts(family)
    want = ref_encodings(family, add_special_tokens)
    got = cli.encode(FIXTURES / family, ts, add_special_tokens)
    failures = []
    for text, w, g in zip(ts, want, got):
        if "ids" not in g or g.get("ids") != w["ids"] or g.get("offsets") != w["offsets"] \
                or g.get("tokens") != w["tokens"]:
            if "ids" not in g:
                failures.append(f"text={text!r}\n  want: {w!r}\n  got:  {g!r}")
                continue
            field = next(k for k in ("ids", "tokens", "offsets") if g.get(k) != w[k])
            i = _first_diff(w[field], g.get(field) or [])
            failures.append(
                f"text={text!r}\n  first {field} difference at index {i}\n"
                f"  want ids:     {w['ids']}\n  got ids:      {g.get('ids')}\n"
                f"  want tokens:  {w['tokens']}\n  got tokens:   {g.get('tokens')}\n"
                f"  want offsets: {w['offsets']}\n  got offsets:  {g.get('offsets')}")
    if failures:
        fail_report(family, f"encode(add_special_tokens={add_special_tokens})", failures, len(ts))


@params_family
@pytest.mark.parametrize("skip", [False, True], ids=["keep_special", "skip_special"])
def test_decode(cli, family, skip):
    ts = texts(family)
    ids_lists = [e["ids"] for e in ref_encodings(family, True)]
    want = reference(family).decode_batch(ids_lists, skip)
    got = cli.decode(FIXTURES / family, ids_lists, skip)
    failures = [f"text={t!r}\n  ids={ids}\n  want: {w!r}\n  got:  {g.get('text', g)!r}"
                for t, ids, w, g in zip(ts, ids_lists, want, got) if g.get("text") != w]
    if failures:
        fail_report(family, f"decode(skip_special_tokens={skip})", failures, len(ts))


def _check_stream(ids_lists, want, got, labels, lenient_invalid_utf8=False) -> list[str]:
    """lenient_invalid_utf8: when the reference decode holds U+FFFD, do not require
    the pieces to add up to it. HF's ByteFallback decoder turns a whole run of
    byte tokens into one U+FFFD per byte as soon as the run is not valid UTF-8,
    so a later invalid byte can retroactively change text that was valid (and
    already streamed); no incremental decoder can match that."""
    failures = []
    for label, ids, w, g in zip(labels, ids_lists, want, got):
        pieces = g.get("pieces")
        problem = None
        if not isinstance(pieces, list) or g.get("text") != "".join(pieces):
            problem = "output malformed or text != concatenation of pieces"
        elif lenient_invalid_utf8 and "\ufffd" in w:
            pass
        elif "".join(pieces) != w:
            problem = "concatenated pieces != reference decode"
        elif "\ufffd" not in w and any("\ufffd" in p for p in pieces):
            problem = "a piece contains U+FFFD but the reference decode does not"
        if problem:
            failures.append(f"{label}\n  ids={list(ids)}\n  {problem}\n  want: {w!r}\n"
                            f"  got pieces: {pieces!r}" + ("" if pieces is not None else f"\n  got: {g!r}"))
    return failures


@params_family
@pytest.mark.parametrize("skip", [False, True], ids=["keep_special", "skip_special"])
def test_stream(cli, family, skip):
    ts = texts(family)
    ids_lists = [e["ids"] for e in ref_encodings(family, True)]
    want = reference(family).decode_batch(ids_lists, skip)
    got = cli.stream(FIXTURES / family, ids_lists, skip)
    failures = _check_stream(ids_lists, want, got, [f"text={t!r}" for t in ts])
    if failures:
        fail_report(family, f"stream(skip_special_tokens={skip})", failures, len(ts))


@params_family
@pytest.mark.parametrize("skip", [False, True], ids=["keep_special", "skip_special"])
def test_decode_random_ids(cli, family, skip):
    ids_lists = random_id_lists(family)
    want = reference(family).decode_batch(ids_lists, skip)
    got = cli.decode(FIXTURES / family, ids_lists, skip)
    failures = [f"random ids={list(ids)}\n  want: {w!r}\n  got:  {g.get('text', g)!r}"
                for ids, w, g in zip(ids_lists, want, got) if g.get("text") != w]
    got_s = cli.stream(FIXTURES / family, ids_lists, skip)
    failures += _check_stream(ids_lists, want, got_s, ["random ids (stream)"] * len(ids_lists),
                              lenient_invalid_utf8=True)
    if failures:
        fail_report(family, f"decode/stream of random id sequences (skip_special_tokens={skip})",
                    failures, 2 * len(ids_lists))

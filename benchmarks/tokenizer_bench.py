#!/usr/bin/env python3
"""Tokenizer encode throughput: ours (C++) against HF `tokenizers` and `sentencepiece`.

Trains realistic-size tokenizers (32k byte-level BPE as GPT-2, Llama 3 style split-regex BPE,
and a Llama 2 style SentencePiece BPE converted by transformers) on local text with the
fixture builders, caches them under benchmarks/data/, and encodes a multi-megabyte text line
by line, single-threaded, with each implementation in the same run. Prints MB/s, tokens/s,
our/their ratio, and whether the ids are identical.

    python3 benchmarks/tokenizer_bench.py [--build-dir build] [--vocab 32000] [--mb 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures"))
import make_tokenizer_fixtures as fx  # noqa: E402


def build_tokenizers(data: Path, vocab: int) -> dict[str, Path]:
    out = data / f"tokenizers-{vocab}"
    wanted = {"byte-level BPE (gpt2)": out / "gpt2",
              "Llama-3-style BPE": out / "llama3",
              "SentencePiece-style BPE (llama2)": out / "llama2"}
    if all((p / "tokenizer.json").exists() for p in wanted.values()):
        return wanted
    print(f"training {vocab}-token tokenizers into {out} (once)...", flush=True)
    fx.VOCAB = vocab
    docs = fx.training_documents()
    fx.make_gpt2(out, docs)
    fx.make_llama3(out, docs)
    # SentencePiece cannot learn more pieces than the local text supports; Llama 2's 32k needs
    # more text than we generate, so its vocabulary is capped.
    fx.VOCAB = min(vocab, 16000)
    fx.make_llama2_family(out, fx.llama_spm_model(fx.training_lines(docs)))
    return wanted


def bench_text(data: Path, megabytes: float) -> Path:
    path = data / f"text-{megabytes}mb.txt"
    if path.exists():
        return path
    rng = random.Random(7)
    parts: list[str] = []
    size = 0
    sources = fx.stdlib_sources()
    while size < megabytes * 1e6:
        r = rng.random()
        if r < 0.45:
            s = fx.english_paragraph(rng)
        elif r < 0.75:
            s = sources[rng.randrange(len(sources))][:4000]
        elif r < 0.85:
            s = fx.c_code(rng)
        elif r < 0.93:
            s = fx.cjk_text(rng)
        else:
            s = fx.other_scripts(rng)
        parts.append(s)
        size += len(s.encode())
    path.write_text("\n".join(parts))
    return path


def run_ours(binary: Path, model_dir: Path, text: Path, repeats: int):
    out = subprocess.run([str(binary), str(model_dir), str(text), str(repeats)], check=True,
                         capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        fields[key] = value
    ids = [int(x) for x in fields["ids"].split()] if fields.get("ids") else []
    return float(fields["seconds"]), ids


def time_lines(encode, lines: list[str], repeats: int):
    best, ids = float("inf"), []
    for r in range(repeats):
        t0 = time.perf_counter()
        result = [encode(line) for line in lines]
        best = min(best, time.perf_counter() - t0)
        if r == 0:
            ids = [i for seq in result for i in seq]
    return best, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tokenizers import Tokenizer
    import sentencepiece as spm

    binary = (REPO / args.build_dir / "benchmarks" / "tokenizer_bench").resolve()
    data = REPO / "benchmarks" / "data"
    data.mkdir(parents=True, exist_ok=True)
    families = build_tokenizers(data, args.vocab)
    text_path = bench_text(data, args.mb)
    text = text_path.read_text()
    lines = text.split("\n")
    mb = len(text.encode()) / 1e6
    print(f"text: {mb:.2f} MB, {len(lines)} lines; single thread; best of {args.repeats}\n")
    header = f"{'tokenizer':34} {'impl':22} {'MB/s':>8} {'Mtok/s':>8} {'ours/them':>10} {'ids equal':>10}"
    print(header)
    print("-" * len(header))
    worst_ratio = None
    for name, folder in families.items():
        ours_s, ours_ids = run_ours(binary, folder, text_path, args.repeats)
        ntok = len(ours_ids)
        print(f"{name:34} {'ours (C++)':22} {mb / ours_s:8.2f} {ntok / ours_s / 1e6:8.2f} {'':>10} {'':>10}")
        hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        hf_s, hf_ids = time_lines(lambda s: hf.encode(s, add_special_tokens=False).ids, lines,
                                  args.repeats)
        ratio = hf_s / ours_s
        worst_ratio = ratio if worst_ratio is None else min(worst_ratio, ratio)
        print(f"{'':34} {'HF tokenizers':22} {mb / hf_s:8.2f} {len(hf_ids) / hf_s / 1e6:8.2f} "
              f"{ratio:9.2f}x {str(hf_ids == ours_ids):>10}")
        model = folder / "tokenizer.model"
        if model.exists():
            sp = spm.SentencePieceProcessor(model_file=str(model), add_bos=False)
            sp_s, sp_ids = time_lines(lambda s: sp.encode(s), lines, args.repeats)
            print(f"{'':34} {'sentencepiece':22} {mb / sp_s:8.2f} {len(sp_ids) / sp_s / 1e6:8.2f} "
                  f"{sp_s / ours_s:9.2f}x {str(sp_ids == ours_ids):>10}")
    print(f"\nslowest ratio against HF tokenizers: {worst_ratio:.2f}x (goal: 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

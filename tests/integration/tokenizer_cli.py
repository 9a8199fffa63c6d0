"""Runs the C++ `tgis-tokenizer` command-line tool for tests.

Contract (one process per call; every input line gets exactly one output line):

  tgis-tokenizer encode MODEL_DIR [--no-special-tokens]
      stdin: one JSON string per line  ->  {"ids":[..],"tokens":[..],"offsets":[[s,e],..]}
      (byte offsets) or {"error":"..."}
  tgis-tokenizer decode MODEL_DIR [--skip-special-tokens]
      stdin: one JSON array of ids per line  ->  {"text":"..."}
  tgis-tokenizer stream MODEL_DIR [--skip-special-tokens]
      stdin: one JSON array of ids per line; ids are fed one at a time to the
      incremental decoder  ->  {"pieces":["..",..],"text":"<concatenation>"}

The binary is $TGIS_TOKENIZER_CLI, else build/tokenizer/tgis-tokenizer under the
repository root.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "tokenizers"


def cli_path() -> Path:
    env = os.environ.get("TGIS_TOKENIZER_CLI")
    if env:
        p = Path(env)
        return p if p.is_absolute() else REPO_ROOT / p
    return REPO_ROOT / "build" / "tokenizer" / "tgis-tokenizer"


def cli_available() -> bool:
    p = cli_path()
    return p.is_file() and os.access(p, os.X_OK)


def skip_reason() -> str:
    return (f"tgis-tokenizer CLI not found at {cli_path()} "
            "(build the project, or set TGIS_TOKENIZER_CLI)")


class CliError(AssertionError):
    pass


def run_lines(args: Sequence[str], lines: Sequence[str], timeout: float = 600.0) -> list[dict]:
    """Runs the tool once with `lines` (already serialized, no newlines inside) on
    stdin; returns one parsed JSON object per input line. A line of output that is
    not valid UTF-8 or not valid JSON comes back as {"__bad_output__": repr(raw)}."""
    cmd = [str(cli_path()), *args]
    data = "".join(line + "\n" for line in lines).encode("ascii")
    proc = subprocess.run(cmd, input=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout)
    if proc.returncode != 0:
        raise CliError(f"{' '.join(cmd)} exited with {proc.returncode}; stderr:\n"
                       f"{proc.stderr.decode('utf-8', 'replace')[-4000:]}")
    raw = proc.stdout.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    if len(raw) != len(lines):
        raise CliError(f"{' '.join(cmd)}: {len(lines)} input lines but {len(raw)} output lines; "
                       f"stderr:\n{proc.stderr.decode('utf-8', 'replace')[-4000:]}")
    out = []
    for r in raw:
        try:
            out.append(json.loads(r.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            out.append({"__bad_output__": repr(r)})
    return out


def encode(model_dir, texts: Iterable[str], add_special_tokens: bool = True) -> list[dict]:
    args = ["encode", str(model_dir)] + ([] if add_special_tokens else ["--no-special-tokens"])
    return run_lines(args, [json.dumps(t) for t in texts])


def decode(model_dir, ids_lists: Iterable[Sequence[int]], skip_special_tokens: bool = False) -> list[dict]:
    args = ["decode", str(model_dir)] + (["--skip-special-tokens"] if skip_special_tokens else [])
    return run_lines(args, [json.dumps(list(x)) for x in ids_lists])


def stream(model_dir, ids_lists: Iterable[Sequence[int]], skip_special_tokens: bool = False) -> list[dict]:
    args = ["stream", str(model_dir)] + (["--skip-special-tokens"] if skip_special_tokens else [])
    return run_lines(args, [json.dumps(list(x)) for x in ids_lists])


def families() -> list[str]:
    """Fixture model folders (tests/fixtures/tokenizers/<family>/)."""
    if not FIXTURES.is_dir():
        return []
    return sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (
        (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()
        or (p / "spiece.model").is_file()))

"""What every module uses: the repository root, the log line, number formatting."""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(x, spec=".1f", none="n/a"):
    return none if x is None else format(x, spec)


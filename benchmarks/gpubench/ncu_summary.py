"""Where a decode step's GPU time goes, from the Nsight Compute CSV that `engine_only --ncu`
writes (one metric: gpu__time_duration.sum of every kernel of a short engine_bench run).

    python3 -m gpubench.ncu_summary NCU_CSV

Each forward pass starts with the embedding lookup, so the kernels from the last
EmbeddingKernel on are the run's last decode step. They are grouped by kernel (templates
shortened) and grid, heaviest first: calls, total and mean microseconds. ncu locks the clocks
and serializes kernels, so small kernels read slower than they run and the sum leaves out the
gaps between kernels; the step's wall time comes from the same run without ncu.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path


def short_name(name: str) -> str:
    name = re.sub(r"\(.*", "", name)  # the argument list
    name = re.sub(r"^void ", "", name)
    return re.sub(r"tgis::(kernels::cuda::)?(<unnamed>::)?", "", name)


def last_step(rows: list[dict]) -> list[dict]:
    starts = [i for i, r in enumerate(rows) if "EmbeddingKernel" in r["Kernel Name"]]
    return rows[starts[-1]:] if starts else rows


def summarize(path: Path) -> str:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("==")]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        return f"{path}: no gpu__time_duration.sum rows"
    step = last_step(rows)
    groups: dict[tuple[str, str], list[float]] = {}
    for r in step:
        us = float(r["Metric Value"].replace(",", "")) / 1e3  # ns, with thousands separators
        groups.setdefault((short_name(r["Kernel Name"]), r["Grid Size"]), []).append(us)
    total = sum(sum(v) for v in groups.values())
    out = [f"last decode step: {len(step)} kernels, {total:.1f} us of kernel time (ncu clocks)",
           f"{'total us':>9} {'calls':>5} {'mean us':>8}  kernel, grid"]
    for (name, grid), us in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"{sum(us):9.1f} {len(us):5d} {sum(us) / len(us):8.2f}  {name[:70]}, {grid}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m gpubench.ncu_summary NCU_CSV", file=sys.stderr)
        return 2
    print(summarize(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

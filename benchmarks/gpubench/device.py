"""The device's name for the report, and a python whose torch sees a CUDA GPU (for the bandwidth
and the HF run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def device_name(device: str) -> str:
    if device != "cpu" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if device == "cpu" or not shutil.which("nvidia-smi"):
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
        except OSError:
            pass
    return "unknown"


def find_torch_python(explicit: str | None) -> tuple[str | None, dict | str]:
    """(a python whose torch sees a CUDA GPU, its versions), or (None, why none)."""
    candidates = [explicit] if explicit else []
    candidates += [sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]
    reasons = []
    seen = set()
    probe = ("import json, torch\nr = {'torch': torch.__version__, 'cuda': torch.cuda.is_available()}\n"
             "try:\n  import transformers; r['transformers'] = transformers.__version__\n"
             "except Exception as e:\n  r['transformers'] = None\nprint(json.dumps(r))")
    for py in candidates:
        if not py or py in seen or not (Path(py).exists() or shutil.which(py)):
            continue
        seen.add(py)
        try:
            out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"{py}: {e}")
            continue
        if out.returncode != 0:
            reasons.append(f"{py}: no torch")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if not r["cuda"]:
            reasons.append(f"{py}: torch {r['torch']} without CUDA")
            continue
        return py, r
    return None, "; ".join(reasons) or "no python found"

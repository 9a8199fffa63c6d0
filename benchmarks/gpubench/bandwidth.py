"""The HBM bandwidth, for the batch-1 decode roofline: a torch device-to-device copy of 2 GiB,
timed with CUDA events, best of 10, in the torch python."""

from __future__ import annotations

from .result_script import run_result_script

BANDWIDTH_SCRIPT = r'''
import json, torch
n = 1 << 30                                   # bf16 elements: 2 GiB per tensor
x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
best = 0.0
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); y.copy_(x); e.record(); e.synchronize()
    best = max(best, 2 * x.numel() * x.element_size() / (s.elapsed_time(e) / 1e3))
print("RESULT " + json.dumps({"hbm_bytes_per_s": best, "torch_device": torch.cuda.get_device_name(),
                               "copy_bytes": x.numel() * x.element_size()}))
'''


def measure_bandwidth(py: str) -> dict:
    return run_result_script(py, BANDWIDTH_SCRIPT, [], 120, "HBM bandwidth")

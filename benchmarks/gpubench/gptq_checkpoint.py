"""A GPTQ 4-bit copy of the benchmark's shape with random codes: every linear of the decoder
layers packed as AutoGPTQ writes it (qweight, qzeros in the v1 format, f16 scales, g_idx;
symmetric, groups of 128, no act-order), embeddings, norms and lm_head in bf16, as GPTQ leaves
them. Random codes, not a quantized model: it is for timing the 4-bit decode kernels on the
8B shape, which needs no weights that mean anything."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from .checkpoint import (ITEMSIZE, MARKER, TOKENIZER_FILES, bf16_pool, checkpoint_complete,
                         model_config, special_ids, tensor_shapes, tokenizer_fixture, typed_header,
                         write_tiled)
from .common import log

GROUP = 128
FORMAT_VERSION = 1


def gptq_tensors(config: dict) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, shape, dtype, fill) in HF's order: fill is codes, zeros, scales, g_idx, bf16 or
    ones (norms)."""
    out = []
    for name, shape, norm in tensor_shapes(config):
        layer_linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
        if not layer_linear:
            out.append((name, shape, "BF16", "ones" if norm else "bf16"))
            continue
        rows, cols = shape
        base = name[: -len(".weight")]
        out += [(base + ".qweight", (cols // 8, rows), "I32", "codes"),
                (base + ".qzeros", (cols // GROUP, rows // 8), "I32", "zeros"),
                (base + ".scales", (cols // GROUP, rows), "F16", "scales"),
                (base + ".g_idx", (cols,), "I32", "g_idx")]
    return out


def small_fill(kind: str, n: int, rng: np.random.Generator) -> bytes:
    if kind == "zeros":  # v1 format: zero - 1, so 7 for the symmetric zero 8
        return np.full(n, 0x77777777, np.uint32).tobytes()
    if kind == "scales":  # about what N(0, 0.02) weights quantize to (max |w| / 7)
        return rng.uniform(0.006, 0.012, n).astype(np.float16).tobytes()
    if kind == "g_idx":
        return (np.arange(n, dtype=np.int32) // GROUP).tobytes()
    return np.full(n, 0x3F80, np.uint16).tobytes()  # norms: ones


def make_gptq_checkpoint(folder: Path, shape: dict) -> dict:
    """Writes (or reuses) the GPTQ 4-bit g128 copy of `shape` in `folder`."""
    tok_dir = tokenizer_fixture()
    bos, eos = special_ids(tok_dir)
    config = model_config(shape, bos, eos)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                     "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
    specs = gptq_tensors(config)
    info = {"folder": str(folder), "quantization": config["quantization_config"]}
    if checkpoint_complete(folder, config):
        log(f"reusing the GPTQ checkpoint in {folder}")
        return dict(info, reused=True)
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    for p in folder.glob("model*.safetensors"):
        p.unlink()
    rng = np.random.default_rng(2)
    # Pools of random words (4-bit codes, 8 a word) and of bf16 values, tiled: odd lengths so
    # that rows shift against each other.
    codes = memoryview(rng.integers(0, 2**32, 16_777_259, dtype=np.uint32)).cast("B")
    bf16 = memoryview(bf16_pool(25_165_843)).cast("B")
    entries = [(name, shp, dtype) for name, shp, dtype, _ in specs]
    total = sum(ITEMSIZE[dtype] * math.prod(shp) for _, shp, dtype in entries)
    fname = "model.safetensors"
    log(f"writing a GPTQ 4-bit checkpoint ({total / 1e9:.2f} GB) to {folder}")
    with open(folder / fname, "wb") as f:
        f.write(typed_header(entries))
        for name, shp, dtype, kind in specs:
            n = math.prod(shp)
            if kind in ("codes", "bf16"):
                pool = codes if kind == "codes" else bf16
                write_tiled(f, pool, ITEMSIZE[dtype] * n, 4 * int(rng.integers(0, len(pool) // 4)))
            else:
                f.write(small_fill(kind, n, rng))
    files = {fname: (folder / fname).stat().st_size}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copyfile(tok_dir / name, folder / name)
    (folder / MARKER).write_text(json.dumps(
        {"format": FORMAT_VERSION, "config": config, "files": files}, indent=2))
    info.update(reused=False, bytes=total, write_seconds=round(time.perf_counter() - t0, 1))
    log(f"GPTQ checkpoint written in {info['write_seconds']} s")
    return info

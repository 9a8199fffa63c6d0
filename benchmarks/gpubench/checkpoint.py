"""The benchmark's checkpoint: a HF Llama folder with random bf16 weights (safetensors shards),
written with numpy and reused while its marker file matches; the tokenizer is a copy of the
test fixture."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from .common import REPO, log

TOKENIZER_FIXTURES = REPO / "tests" / "fixtures" / "tokenizers"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MARKER = ".gpu_bench_complete.json"
FORMAT_VERSION = 1

LLAMA3_8B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
}
TINY = {
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 128256,
}


def tokenizer_fixture() -> Path:
    for name in ("llama3", "gpt2"):
        d = TOKENIZER_FIXTURES / name
        if (d / "tokenizer.json").exists():
            return d
    raise SystemExit(f"no tokenizer fixture (llama3 or gpt2) under {TOKENIZER_FIXTURES}")


def special_ids(tok_dir: Path) -> tuple[int, int]:
    """(bos, eos) ids of the fixture tokenizer, from its special tokens and added tokens."""
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tok["model"].get("vocab")
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    ids.update({a["content"]: a["id"] for a in tok.get("added_tokens", [])})
    names = {}
    for f in ("special_tokens_map.json", "tokenizer_config.json"):
        if (tok_dir / f).exists():
            for key in ("bos_token", "eos_token"):
                v = json.loads((tok_dir / f).read_text()).get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if v and key not in names:
                    names[key] = v
    eos = ids.get(names.get("eos_token", ""), 0)
    bos = ids.get(names.get("bos_token", ""), eos)
    return bos, eos


def model_config(shape: dict, bos: int, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
        "transformers_version": "4.44.0",
    }


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) in HF's order."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h), False)]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h), False),
            (p + "self_attn.k_proj.weight", (kv, h), False),
            (p + "self_attn.v_proj.weight", (kv, h), False),
            (p + "self_attn.o_proj.weight", (h, q), False),
            (p + "mlp.gate_proj.weight", (i, h), False),
            (p + "mlp.up_proj.weight", (i, h), False),
            (p + "mlp.down_proj.weight", (h, i), False),
            (p + "input_layernorm.weight", (h,), True),
            (p + "post_attention_layernorm.weight", (h,), True),
        ]
    out += [("model.norm.weight", (h,), True), ("lm_head.weight", (v, h), False)]
    return out


def bf16_pool(n: int, seed: int = 0) -> np.ndarray:
    """n bf16 bit patterns (uint16) of N(0, 0.02), rounded to nearest even from float32."""
    f = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    bits = f.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def plan_shards(specs, max_shard_bytes: int):
    shards, cur, size = [], [], 0
    for name, shape, norm in specs:
        nbytes = 2 * math.prod(shape)
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, norm))
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


ITEMSIZE = {"BF16": 2, "F16": 2, "I32": 4}


def typed_header(entries) -> bytes:
    """A safetensors header for (name, shape, dtype) entries laid out in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        nbytes = ITEMSIZE[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def safetensors_header(tensors) -> bytes:
    return typed_header((name, shape, "BF16") for name, shape, _ in tensors)


def write_tiled(f, pool: memoryview, nbytes: int, off: int) -> None:
    """nbytes of `pool` from byte `off`, wrapping around to its start."""
    while nbytes > 0:
        chunk = pool[off:off + nbytes]
        f.write(chunk)
        nbytes -= len(chunk)
        off = 0


def checkpoint_complete(folder: Path, config: dict) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format") != FORMAT_VERSION or marker.get("config") != config:
        return False
    for name, size in marker.get("files", {}).items():
        p = folder / name
        if not p.exists() or p.stat().st_size != size:
            return False
    return all((folder / f).exists() for f in ("config.json", "tokenizer.json"))


def make_checkpoint(folder: Path, shape: dict, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Writes (or reuses) a HF Llama checkpoint with random bf16 weights in `folder`."""
    tok_dir = tokenizer_fixture()
    bos, eos = special_ids(tok_dir)
    config = model_config(shape, bos, eos)
    specs = tensor_shapes(config)
    total_bytes = sum(2 * math.prod(s) for _, s, _ in specs)
    embed_bytes = 2 * math.prod(specs[0][1])
    info = {"folder": str(folder), "config": config, "tokenizer_fixture": str(tok_dir.relative_to(REPO)),
            "parameters": total_bytes // 2, "weight_bytes": total_bytes}
    t0 = time.perf_counter()
    foreign = (folder / "config.json").exists() and not (folder / MARKER).exists()
    if foreign:
        # Not written by us (e.g. a real Llama-3-8B download): benchmarked as it is, never
        # overwritten.
        config = json.loads((folder / "config.json").read_text())
        info.update(config=config, reused=True, foreign=True, write_seconds=0.0)
        info.pop("tokenizer_fixture")
        log(f"{folder} holds a checkpoint this script did not write: using it as it is")
    elif checkpoint_complete(folder, config):
        info.update(reused=True, write_seconds=0.0)
        log(f"reusing the checkpoint in {folder} ({total_bytes / 1e9:.2f} GB)")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).unlink(missing_ok=True)
        free = shutil.disk_usage(folder).free
        existing = sum(p.stat().st_size for p in folder.glob("model*.safetensors"))
        if free + existing < total_bytes * 1.02:
            raise SystemExit(f"{folder}: {(free + existing) / 1e9:.1f} GB free, the checkpoint "
                             f"needs {total_bytes / 1e9:.1f} GB (use --model-dir elsewhere)")
        for p in folder.glob("model*.safetensors"):
            p.unlink()
        log(f"writing a {total_bytes / 2e9:.2f}B-parameter checkpoint ({total_bytes / 1e9:.2f} GB) "
            f"to {folder}")
        pool_n = 25_165_843  # ~48 MB of bf16; odd so that tiled rows shift against each other
        pool = bf16_pool(pool_n)
        pool_mv = memoryview(pool).cast("B")
        ones = memoryview(np.full(max(s[0] for _, s, n in specs if n), 0x3F80, np.uint16)).cast("B")
        rng = np.random.default_rng(1)
        shards = plan_shards(specs, max_shard_bytes)
        weight_map, files = {}, {}
        for k, tensors in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            with open(folder / fname, "wb", buffering=0) as f:
                f.write(safetensors_header(tensors))
                for name, shape, norm in tensors:
                    weight_map[name] = fname
                    nbytes = 2 * math.prod(shape)
                    if norm:
                        f.write(ones[:nbytes])
                        continue
                    write_tiled(f, pool_mv, nbytes, 2 * int(rng.integers(0, pool_n)))
            files[fname] = (folder / fname).stat().st_size
            log(f"  {fname}: {files[fname] / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)")
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False,
             "transformers_version": config["transformers_version"]}, indent=2))
        for name in TOKENIZER_FILES:
            if (tok_dir / name).exists():
                shutil.copyfile(tok_dir / name, folder / name)
        (folder / MARKER).write_text(json.dumps(
            {"format": FORMAT_VERSION, "config": config, "files": files}, indent=2))
        info.update(reused=False, write_seconds=round(time.perf_counter() - t0, 1))
        log(f"checkpoint written in {info['write_seconds']} s")
    # Bytes read per decoded token, from the checkpoint's own headers: every weight except the
    # embedding table (a row lookup), unless the embedding is also the (tied) LM head.
    sizes = {}
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                sizes[name] = t["data_offsets"][1] - t["data_offsets"][0]
    embed = "model.embed_tokens.weight"
    tied = "lm_head.weight" not in sizes
    per_token = sum(v for k, v in sizes.items() if k != embed or tied)
    if not foreign:
        assert per_token == total_bytes - embed_bytes, (per_token, total_bytes, embed_bytes)
    else:
        info.update(parameters=None, weight_bytes=sum(sizes.values()))
    info["weight_bytes_per_token"] = per_token
    return info

#!/usr/bin/env python3
"""CPU engine benchmark: ours against HF transformers on the same random checkpoint.

Makes a ~100M-parameter Llama-shaped checkpoint (--arch mixtral: a Mixtral-shaped one of 178M
parameters, 8 experts of which 2 run a token; --arch gemma2: the Llama shape as Gemma 2, with
its four norms a layer, soft caps and tied embeddings; --arch qwen3: the Llama shape as
Qwen3, with its per-head q/k norms; --arch gemma3: as Gemma 3, Gemma 2's layer with q/k norms,
windows on five layers of six and their own rotary base) with random weights (numpy + safetensors, under
benchmarks/data/, nothing downloaded, nothing committed), runs build/benchmarks/engine_bench on
it (prefill and decode tokens/s at batch 1 and 16; memory bandwidth measured in the same run
and the fraction of it batch-1 decode achieves), then HF transformers on the same folder when a
python with torch is available (Debian's python3-torch for /usr/bin/python3 works).

    python3 benchmarks/engine_bench.py [--build-dir build] [--dtype float32|bfloat16]
                                       [--arch llama|mixtral|gemma2|qwen3|gemma3]
                                       [--lora-rank R]

--lora-rank R adds a LoRA adapter of rank R on every linear of every layer (random A and B, as
PEFT saves them, under benchmarks/data/) and runs each engine with and without it: ours with
the adapter on every sequence (engine_bench --lora), transformers with PEFT's unmerged LoRA
layers (when `peft` imports), and prints each engine's ratio of adapted to base speed.

transformers >= 4.51 runs Qwen3 and Gemma 3 (a venv with PyPI's torch, as
tests/fixtures/models/README.md makes for their fixtures: run this script with that venv's
python).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
}

# A sparse mixture of experts: 57M parameters read per token past the embedding.
MIXTRAL_CONFIG = {
    **CONFIG, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rope_theta": 1e6,
}

# Gemma 2 at the Llama shape: soft caps 50 and 30 (Gemma 2's own), a window past every prompt.
GEMMA2_CONFIG = {
    **CONFIG, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "sliding_window": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}

# Qwen3 at the Llama shape: q/k RMSNorms over each head's 64 values.
QWEN3_CONFIG = {
    **CONFIG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "use_sliding_window": False,
}

# Gemma 3 at the Llama shape: Gemma 3 1B's window (512, past the default prompt) on five layers
# of six, rotated with base 10000 where the others take 1e6; no soft caps (as released).
GEMMA3_CONFIG = {
    **CONFIG, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
del GEMMA3_CONFIG["hidden_act"]

# --arch: the checkpoint's folder under benchmarks/data and its config.
ARCHS = {
    "llama": ("llama-100m", CONFIG),
    "mixtral": ("mixtral-180m", MIXTRAL_CONFIG),
    "gemma2": ("gemma2-100m", GEMMA2_CONFIG),
    "qwen3": ("qwen3-100m", QWEN3_CONFIG),
    "gemma3": ("gemma3-100m", GEMMA3_CONFIG),
}

HF_SCRIPT = r'''
import sys, time, torch
from transformers import AutoModelForCausalLM, DynamicCache
path, prompt, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
if len(sys.argv) > 4:  # a LoRA adapter, unmerged (PEFT's LoRA layers, as served per request)
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, sys.argv[4]).eval()
for batch in (1, 16):
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    with torch.no_grad():
        t0 = time.perf_counter()
        # A DynamicCache given: Gemma 2's default HybridCache needs torch._dynamo.
        out = model(ids, past_key_values=DynamicCache(), use_cache=True)
        prefill = time.perf_counter() - t0
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - t0
    print(f"batch {batch}: prefill {batch * prompt / prefill:.1f} tok/s, "
          f"decode {batch * steps / decode:.1f} tok/s ({decode / steps * 1e3:.1f} ms/step)")
'''


def make_checkpoint(folder: Path, config: dict | None = None) -> None:
    """A Llama (or, with num_local_experts, Mixtral) checkpoint of `config` (default CONFIG) with
    random weights in `folder`."""
    if (folder / "model.safetensors").exists():
        return
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    c = config or CONFIG
    rng = np.random.default_rng(0)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    kv = c["num_key_value_heads"] * d

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    gemma = c["model_type"] in ("gemma2", "gemma3_text")
    # Gemma stores its norm weights as offsets from 1: zeros scale by 1.
    one = 0.0 if gemma else 1.0
    norm = lambda n=h: np.full(n, one, np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": norm()}
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(v, h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
        })
        if c["model_type"] in ("qwen3", "gemma3_text"):
            tensors.update({p + "self_attn.q_norm.weight": norm(d),
                            p + "self_attn.k_norm.weight": norm(d)})
        if gemma:
            tensors.update({p + "pre_feedforward_layernorm.weight": norm(),
                            p + "post_feedforward_layernorm.weight": norm()})
        experts = c.get("num_local_experts", 0)
        if experts == 0:
            tensors.update({p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                            p + "mlp.down_proj.weight": w(h, i)})
            continue
        m = p + "block_sparse_moe."
        tensors[m + "gate.weight"] = w(experts, h)
        for e in range(experts):
            tensors.update({f"{m}experts.{e}.w1.weight": w(i, h), f"{m}experts.{e}.w3.weight": w(i, h),
                            f"{m}experts.{e}.w2.weight": w(h, i)})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    params = sum(t.size for t in tensors.values())
    print(f"made a {params / 1e6:.0f}M-parameter checkpoint in {folder}")


def make_lora(folder: Path, config: dict, rank: int) -> None:
    """A PEFT LoRA adapter of `rank` on q/k/v/o and gate/up/down of every layer, random A and B
    (scaled so the adapted model stays near the base one), as save_pretrained lays it out."""
    if (folder / "adapter_model.safetensors").exists():
        return
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim", h // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out, inp) in shapes.items():
            p = f"base_model.model.model.layers.{layer}.{module}."
            tensors[p + "lora_A.weight"] = (rng.standard_normal((rank, inp)) * 0.02).astype(np.float32)
            tensors[p + "lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.02).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted(m.split(".")[1] for m in shapes), "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
    }, indent=2))


def torch_python() -> str | None:
    for py in (sys.executable, "/usr/bin/python3"):
        if shutil.which(py) or Path(py).exists():
            ok = subprocess.run([py, "-c", "import torch, transformers"], capture_output=True)
            if ok.returncode == 0:
                return py
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--arch", choices=tuple(ARCHS), default="llama")
    ap.add_argument("--lora-rank", type=int, default=0)
    args = ap.parse_args()
    name, config = ARCHS[args.arch]
    folder = REPO / "benchmarks" / "data" / name
    make_checkpoint(folder, config)
    binary = REPO / args.build_dir / "benchmarks" / "engine_bench"
    lora = None
    if args.lora_rank > 0:
        if config is not CONFIG:
            ap.error("--lora-rank: the llama shape only")
        lora = folder.parent / f"{name}-lora-r{args.lora_rank}"
        make_lora(lora, config, args.lora_rank)
    runs = [None] if lora is None else [None, lora]
    figures = {}  # (engine, adapter) -> {batch: (prefill, decode)}

    def run(engine: str, adapter: Path | None, cmd: list[str]) -> None:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(out, end="", flush=True)
        got = figures.setdefault((engine, adapter), {})
        for m in re.finditer(r"batch (\d+): prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s", out):
            got[int(m[1])] = (float(m[2]), float(m[3]))

    for adapter in runs:
        print("== ours (C++ engine, CPU)" + (f", LoRA {adapter.name}" if adapter else ""),
              flush=True)
        run("ours", adapter, [str(binary), str(folder), "--dtype", args.dtype, "--prompt",
                              str(args.prompt), "--steps", str(args.steps)]
            + (["--lora", str(adapter)] if adapter else []))
    py = torch_python()
    if py is None:
        print("== HF transformers: skipped (no python with torch and transformers)")
    else:
        if lora is not None and subprocess.run([py, "-c", "import peft"],
                                               capture_output=True).returncode != 0:
            print("== PEFT: skipped (no peft for that python)")
            runs = [None]
        for adapter in runs:
            print(f"== HF transformers (float32, {py})"
                  + (f", PEFT LoRA {adapter.name}" if adapter else ""), flush=True)
            run("transformers", adapter, [py, "-c", HF_SCRIPT, str(folder), str(args.prompt),
                                          str(args.steps)] + ([str(adapter)] if adapter else []))
    if lora is not None:
        print("== with the adapter / without, per engine")
        for engine in ("ours", "transformers"):
            base, adapted = figures.get((engine, None)), figures.get((engine, lora))
            for batch in sorted(adapted or {}):
                (bp, bd), (ap_, ad) = base[batch], adapted[batch]
                print(f"{engine} batch {batch}: prefill {ap_ / bp:.2f}x, decode {ad / bd:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

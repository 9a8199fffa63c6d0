#!/usr/bin/env python3
"""CPU decode and prefill: ours, llama.cpp and CTranslate2 on one random Llama checkpoint.

    python3 benchmarks/cpu_bench.py [--build-dir build] [--shape tinyllama|small]
                                    [--engines ours,llama.cpp,ctranslate2]
                                    [--precisions f32,bf16,f16,8bit,4bit] [--rounds N]

`make bench-cpu` runs it. Minutes long (tens on first run: it builds llama.cpp and converts
the checkpoint four ways); never part of `make test`. Everything it makes lives under
--work (default benchmarks/data/cpu_bench, git-ignored) and is reused by later runs.

1. A TinyLlama-1.1B-shaped HF checkpoint (hidden 2048, 22 layers, 32 heads, 4 KV heads,
   intermediate 5632, vocabulary 32000) with random f32 weights N(0, 0.02), numpy only; the
   tokenizer is the Llama-2-style test fixture (llama.cpp's converter pads its vocabulary).
   A GPTQ copy (4-bit, groups of 32, symmetric, as AutoGPTQ packs it; the lm_head too, as
   GPTQModel's "lm_head": true does) for our 4-bit path.
2. llama.cpp from the llama-cpp-python source distribution on PyPI (its vendored llama.cpp,
   built with cmake, native ISA): convert_hf_to_gguf.py writes f32, bf16, f16 and Q8_0 GGUFs;
   llama-quantize --pure writes Q4_0 (every tensor Q4_0, the output tensor too, as our
   4-bit copy's head);
   llama-bench measures pp (prefill) and tg (decode, after the prompt's depth: -d) at --threads.
3. CTranslate2 from its PyPI wheel: ct2-transformers-converter (float32 and int8; the CPU
   has no bf16/f16 GEMM in CTranslate2, so those are reported as such) and
   Generator.generate_batch timed: prefill = one token after the prompt, decode = the rest.
4. Ours: build/benchmarks/engine_bench (f32, bf16, f16 from the f32 checkpoint; 8-bit =
   --quantize bitsandbytes, int8 per output row; 4-bit = the GPTQ copy), batch 1.
   "ours-nf4" (4-bit only) serves a bitsandbytes nf4 copy instead (blocks of 64, double
   quantization, the lm_head dense as transformers leaves it).
   "ours-int8act" is the same with --int8-activations true (the shard's
   --cpu-int8-activations), 8- and 4-bit only: x rounded to int8 per 32 columns, as
   llama.cpp's and CTranslate2's quantized types multiply. It also measures the DRAM read bandwidth (all cores, 1 GiB) that the fractions use.

Each engine's decode fraction of the bandwidth = its tok/s x the bytes of its own weight
format streamed per token (every linear layer and the lm_head; not the embedding) / the
measured bandwidth. With --rounds N every engine is measured N times, the engines in
alternation, and each keeps its best decode and prefill (and the bandwidth its best probe):
on a VM whose bandwidth drifts, one pass can move a ratio by 10-20%. The ratios are printed
both ways: best against best, and the median (and range) of each round's own ratio, whose two
figures were measured minutes apart. Python packages go to
--work/pylib (pip --target); the interpreter with torch and transformers (/usr/bin/python3
here, Debian's python3-torch) converts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import make_checkpoint, torch_python  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# 4.6.0: later converters pass from_pretrained(dtype=...), which the transformers here
# (4.49, torch_dtype=) rejects.
CTRANSLATE2 = "ctranslate2==4.6.0"
# protobuf: transformers reads the sentencepiece tokenizer through it when CTranslate2 converts;
# sentencepiece 0.2.0 because later releases ship a model_pb2 generated for protobuf >= 6,
# which the converter's import of it then refuses (4.25.3 runtime).
PY_PACKAGES = [CTRANSLATE2, "gguf==0.19.0", "sentencepiece==0.2.0", "pyyaml", "protobuf==4.25.3"]
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "llama2"

SHAPES = {
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
}
BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
}
PRECISIONS = ["f32", "bf16", "f16", "8bit", "4bit"]


def log(msg: str) -> None:
    print(msg, flush=True)


def run(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join("<script>" if "\n" in str(c) else str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, timeout=timeout, text=True, **kw)


# ---- the checkpoints ------------------------------------------------------------------------

def streamed_params(c: dict) -> tuple[float, float]:
    """(parameters of the linear layers, of the lm_head): what a decode step reads."""
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return float(per_layer * layers), float(c["vocab_size"] * h)


def make_dense(folder: Path, config: dict) -> None:
    make_checkpoint(folder, config)
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"):
        if not (folder / f).exists():
            shutil.copy(TOKENIZER / f, folder / f)


def gptq4_pack(w: np.ndarray, group: int) -> dict:
    """AutoGPTQ's 4-bit symmetric round-to-nearest of w [out, in]: qweight [in / 8, out] and
    qzeros [groups, out / 8] int32 (8 codes per word, low bits first; v1 zeros stored - 1),
    scales [groups, out] f16, g_idx [in]."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    scale = (2 * np.abs(g).max(axis=2) / 15).astype(np.float16)  # [out, groups]
    s = np.maximum(scale.astype(np.float32), 1e-8)[:, :, None]
    codes = np.clip(np.rint(g / s) + 8, 0, 15).astype(np.uint32).reshape(out_f, in_f)
    shifts = (4 * np.arange(8, dtype=np.uint32))[:, None]
    qweight = np.zeros((in_f // 8, out_f), np.uint32)
    ct = codes.T.reshape(in_f // 8, 8, out_f)
    for j in range(8):
        qweight |= ct[:, j, :] << shifts[j]
    zeros = np.full((in_f // group, out_f // 8), 0, np.uint32)
    for j in range(8):
        zeros |= np.uint32(7) << shifts[j]
    return {"qweight": qweight.view(np.int32), "qzeros": zeros.view(np.int32),
            "scales": np.ascontiguousarray(scale.T),
            "g_idx": (np.arange(in_f, dtype=np.int32) // group)}


def make_gptq4(dense: Path, folder: Path, group: int = 32) -> None:
    """The GPTQ copy, the lm_head quantized too (GPTQModel's "lm_head": true), as llama.cpp's
    --pure Q4_0 quantizes its output tensor: the same bytes per token but for the formats'
    constants."""
    cfg_path = folder / "config.json"
    if (folder / "model.safetensors").exists() and cfg_path.exists() and json.loads(
            cfg_path.read_text())["quantization_config"].get("lm_head"):
        return
    from safetensors.numpy import load_file, save_file

    log(f"writing the GPTQ 4-bit copy to {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    src = load_file(str(dense / "model.safetensors"))
    out = {}
    for name, t in src.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            prefix = name[: -len(".weight")]
            for k, v in gptq4_pack(t, group).items():
                out[f"{prefix}.{k}"] = v
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                  "desc_act": False, "sym": True, "checkpoint_format": "gptq",
                                  "lm_head": True}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in dense.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)


# bitsandbytes' nf4 table (functional.get_4bit_type): codes index it, times each block's absmax.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


def dynamic_map() -> np.ndarray:
    """bitsandbytes' create_dynamic_map(signed=True): the 256 values its double quantization
    codes a block's absmax with."""
    data = []
    for i in range(7):
        b = np.linspace(0.1, 1, 2 ** i + 1, dtype=np.float32)
        means = (b[:-1] + b[1:]) / 2
        data += list(10.0 ** (i - 6) * means) + list(-(10.0 ** (i - 6)) * means)
    data += [0.0, 1.0]
    return np.sort(np.array(data + [0.0] * (256 - len(data)), np.float32))


def nearest(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest of the sorted `table` values (bitsandbytes' bucketize on the
    midpoints)."""
    return np.searchsorted((table[:-1] + table[1:]) / 2, values).astype(np.uint8)


def bnb4_pack(w: np.ndarray, name: str, block: int = 64) -> dict:
    """bitsandbytes' quantize_4bit of w [out, in] (nf4, blocks of `block`, double quantization
    of the absmax in blocks of 256), as save_pretrained stores a Linear4bit (in divisible by
    `block`)."""
    blocks = w.reshape(-1, block)
    absmax = np.abs(blocks).max(axis=1)
    codes = nearest(np.clip(blocks * (1 / np.maximum(absmax, 1e-38))[:, None], -1, 1).ravel(),
                    NF4)
    offset = np.float32(absmax.mean())
    shifted = absmax - offset
    pad = (-len(shifted)) % 256
    nested = np.abs(np.pad(shifted, (0, pad))).reshape(-1, 256).max(axis=1)
    per = np.repeat(np.maximum(nested, 1e-38), 256)[: len(shifted)]
    dyn = dynamic_map()
    state = {"quant_type": "nf4", "blocksize": block, "dtype": "float32", "shape": list(w.shape),
             "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(offset)}
    return {name: ((codes[::2] << 4) | codes[1::2])[:, None],
            f"{name}.absmax": nearest(np.clip(shifted / per, -1, 1), dyn),
            f"{name}.quant_map": NF4.copy(), f"{name}.nested_absmax": nested.astype(np.float32),
            f"{name}.nested_quant_map": dyn,
            f"{name}.quant_state.bitsandbytes__nf4": np.frombuffer(
                json.dumps(state).encode(), np.uint8).copy()}


def make_bnb4(dense: Path, folder: Path) -> None:
    """The bitsandbytes nf4 copy (a load_in_4bit model's save_pretrained, double quantization,
    the lm_head left dense as transformers leaves it)."""
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return
    from safetensors.numpy import load_file, save_file

    log(f"writing the bitsandbytes nf4 copy to {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in load_file(str(dense / "model.safetensors")).items():
        out.update(bnb4_pack(t, name) if name.endswith("_proj.weight") else {name: t})
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in dense.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)


# ---- python packages and llama.cpp -------------------------------------------------------------

def ensure_pylib(work: Path) -> Path:
    lib = work / "pylib"
    done = lib / ".done"
    if not done.exists() or done.read_text() != "\n".join(PY_PACKAGES):
        shutil.rmtree(lib, ignore_errors=True)  # another package list: install afresh
        run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--target", lib, *PY_PACKAGES], timeout=900)
        done.write_text("\n".join(PY_PACKAGES))
    return lib


def ensure_llama_cpp(work: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, built: returns its source dir."""
    bin_dir = work / "llama-build" / "bin"
    sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", work, LLAMA_CPP_PYTHON], timeout=900)
        sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    name = sdists[-1].name[: -len(".tar.gz")]
    src = work / "src" / name / "vendor" / "llama.cpp"
    if not src.exists():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(work / "src")
    if not ((bin_dir / "llama-bench").exists() and (bin_dir / "llama-quantize").exists()):
        run(["cmake", "-S", src, "-B", work / "llama-build", "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON"],
            timeout=600)
        run(["ninja", "-C", work / "llama-build", "llama-bench", "llama-quantize"], timeout=3600)
    return src


# ---- the engines ---------------------------------------------------------------------------

def ours(build: Path, dense: Path, gptq: Path, precision: str, prompt: int, steps: int,
         int8_activations: bool = False, bnb4: Path | None = None) -> dict | None:
    if int8_activations and precision not in ("8bit", "4bit"):
        return None  # the mode changes only 8- and 4-bit codes' kernels
    if bnb4 is not None and precision != "4bit":
        return None
    binary = build / "benchmarks" / "engine_bench"
    args = {"f32": (dense, ["--dtype", "float32"]), "bf16": (dense, ["--dtype", "bfloat16"]),
            "f16": (dense, ["--dtype", "float16"]),
            "8bit": (dense, ["--dtype", "bfloat16", "--quantize", "bitsandbytes"]),
            "4bit": (bnb4 or gptq, ["--dtype", "bfloat16"])}[precision]
    extra = ["--int8-activations", "true"] if int8_activations else []
    p = run([binary, args[0], *args[1], *extra, "--prompt", prompt, "--steps", steps,
             "--batches", "1"], timeout=1800, capture_output=True)
    text = p.stdout
    log(text.rstrip())
    got = {"bandwidth_gbs": float(re.search(r"memory_bandwidth_gbs ([\d.]+)", text).group(1)),
           "streamed_bytes": float(re.search(r"streamed/token ([\d.]+) MB", text).group(1)) * 1e6,
           "format": {"8bit": "int8 per row (lm_head too)",
                      "4bit": "bitsandbytes nf4 b64, double quant (lm_head bf16)" if bnb4 else
                      "GPTQ 4-bit g32 sym (lm_head too)"}.get(precision, precision)}
    if int8_activations:
        got["format"] += ", x int8 per 32"
    m = re.search(r"batch 1: prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s", text)
    got.update(prefill=float(m.group(1)), decode=float(m.group(2)))
    return got


GGUF_TYPES = {"f32": "f32", "bf16": "bf16", "f16": "f16", "8bit": "q8_0", "4bit": "q4_0"}
# Bytes per weight of each GGUF type (blocks of 32: Q8_0 34 bytes, Q4_0 18 bytes).
GGUF_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}


# llama.cpp's converter names torch's float8 and uint dtypes in a table at import; Debian's
# torch 1.13 has none of them (and this checkpoint uses none): stand-ins let it import.
CONVERT_SHIM = r'''
import os, runpy, sys, torch
for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if not hasattr(torch, name):
        setattr(torch, name, type("missing_" + name, (), {})())
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def convert_to_gguf(py: str, src: Path, pylib: Path, dense: Path, kind: str, gguf: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(pylib))
    with open(gguf.with_suffix(".log"), "w") as out:
        run([py, "-c", CONVERT_SHIM, src / "convert_hf_to_gguf.py", dense, "--outtype", kind,
             "--outfile", gguf], timeout=1800, env=env, stdout=out, stderr=subprocess.STDOUT)


def llama_cpp(work: Path, src: Path, pylib: Path, dense: Path, precision: str, prompt: int,
              steps: int, threads: int, py: str, params: float) -> dict:
    kind = GGUF_TYPES[precision]
    gguf = work / f"model-{kind}.gguf"
    if not gguf.exists():
        if kind == "q4_0":
            base = work / "model-f32.gguf"
            if not base.exists():
                convert_to_gguf(py, src, pylib, dense, "f32", base)
            with open(gguf.with_suffix(".log"), "w") as out:
                run([work / "llama-build" / "bin" / "llama-quantize", "--pure", base, gguf, "Q4_0",
                     threads], timeout=1800, stdout=out, stderr=subprocess.STDOUT)
        else:
            convert_to_gguf(py, src, pylib, dense, kind, gguf)
    # Two runs: the prompt from an empty cache, and the decode steps after a prompt's worth of
    # context (-d: llama-bench fills the cache first and times only the steps), as ours and
    # CTranslate2 decode after their prompts. A plain `-p P -n N` times its decode from an
    # empty cache: at P = 512 that ran Q4_0 decode 1.2x faster than at depth 512 (47.7 against
    # 39.2 tok/s, 2 threads, EPYC Zen 4), the attention over the prompt left out.
    got = {"format": kind.upper(), "streamed_bytes": params * GGUF_BYTES[kind]}
    for key, shape in (("prefill", ["-p", prompt, "-n", 0]),
                       ("decode", ["-p", 0, "-n", steps, "-d", prompt])):
        p = run([work / "llama-build" / "bin" / "llama-bench", "-m", gguf, "-t", threads, *shape,
                 "-r", 3, "-o", "json"], timeout=1800, capture_output=True)
        got[key] = float(json.loads(p.stdout)[0]["avg_ts"])
    log(f"llama.cpp {kind}: prefill {got.get('prefill', 0):.1f} tok/s, decode "
        f"{got.get('decode', 0):.2f} tok/s")
    return got


CT2_SCRIPT = r'''
import json, sys, time, random
import ctranslate2
path, compute, prompt, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
gen = ctranslate2.Generator(path, device="cpu", compute_type=compute, inter_threads=1,
                            intra_threads=threads)
import os
if os.path.exists(path + "/vocabulary.json"):
    vocab = json.load(open(path + "/vocabulary.json", encoding="utf-8"))
else:
    vocab = [l.rstrip("\n") for l in open(path + "/vocabulary.txt", encoding="utf-8")]
rng = random.Random(0)
tokens = ["<s>"] + [vocab[rng.randrange(3, len(vocab))] for _ in range(prompt - 1)]
def timed(n):
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        r = gen.generate_batch([tokens], max_length=n, min_length=n, sampling_topk=1,
                               include_prompt_in_result=False)
        best = min(best, time.perf_counter() - t0)
        assert len(r[0].sequences_ids[0]) == n, len(r[0].sequences_ids[0])
    return best
first = timed(1)
whole = timed(1 + steps)
print(json.dumps({"prefill": prompt / first, "decode": steps / (whole - first)}))
'''

CT2_TYPES = {"f32": "float32", "8bit": "int8_float32"}
CT2_BYTES = {"f32": 4, "8bit": 1}


def ctranslate2(work: Path, pylib: Path, dense: Path, precision: str, prompt: int, steps: int,
                threads: int, py: str, params: float) -> dict | None:
    if precision not in CT2_TYPES:
        return None
    quant = CT2_TYPES[precision]
    folder = work / f"ct2-{quant}"
    env = dict(os.environ, PYTHONPATH=str(pylib))
    if not (folder / "model.bin").exists():
        run([py, "-m", "ctranslate2.converters.transformers", "--model", dense, "--output_dir",
             folder, "--quantization", quant, "--force"], timeout=1800, env=env)
    p = run([py, "-c", CT2_SCRIPT, folder, quant, prompt, steps, threads], timeout=1800, env=env,
            capture_output=True)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    got.update(format=quant, streamed_bytes=params * CT2_BYTES[precision])
    log(f"ctranslate2 {quant}: prefill {got['prefill']:.1f} tok/s, decode {got['decode']:.2f} tok/s")
    return got


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "data" / "cpu_bench"))
    ap.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    # ours-int8act: ours with --cpu-int8-activations (8- and 4-bit only), the way llama.cpp's
    # Q8_0/Q4_0 and CTranslate2's int8 multiply: x rounded to int8.
    ap.add_argument("--engines", default="ours,ours-int8act,ours-nf4,llama.cpp,ctranslate2")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    # On a VM whose memory bandwidth drifts from minute to minute, one pass can move a ratio by
    # 10-20%: N rounds measure every engine N times in alternation and keep each one's best.
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_bench.json"))
    args = ap.parse_args()
    engines = args.engines.split(",")
    precisions = args.precisions.split(",")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    build = (REPO / args.build_dir).resolve()
    config = dict(BASE_CONFIG, **SHAPES[args.shape])
    dense = work / f"llama-{args.shape}"
    gptq = work / f"llama-{args.shape}-gptq4"
    make_dense(dense, config)
    if "4bit" in precisions and {"ours", "ours-int8act"} & set(engines):
        make_gptq4(dense, gptq)
    bnb4 = work / f"llama-{args.shape}-bnb4"
    if "4bit" in precisions and "ours-nf4" in engines:
        make_bnb4(dense, bnb4)
    linear, head = streamed_params(config)
    params = linear + head
    py = torch_python()
    pylib = ensure_pylib(work) if {"llama.cpp", "ctranslate2"} & set(engines) else None
    src = ensure_llama_cpp(work) if "llama.cpp" in engines else None
    if "llama.cpp" in engines and py is None:
        log("llama.cpp: no python with torch and transformers for convert_hf_to_gguf.py (Debian "
            "12: apt-get install python3-torch; /usr/bin/python3 -m pip install "
            "--break-system-packages transformers==4.49.0): GGUFs converted before are used, "
            "others fail to convert")
    if "ctranslate2" in engines and py is None:
        log("ctranslate2: skipped (its converter needs a python with torch and transformers)")
        engines.remove("ctranslate2")

    results: dict = {"shape": args.shape, "config": config, "threads": args.threads,
                     "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds,
                     "engines": {}}
    bandwidth = None
    for round_index in range(args.rounds):
        for precision in precisions:
            for engine in engines:
                t0 = time.time()
                if engine in ("ours", "ours-int8act", "ours-nf4"):
                    got = ours(build, dense, gptq, precision, args.prompt, args.steps,
                               int8_activations=engine == "ours-int8act",
                               bnb4=bnb4 if engine == "ours-nf4" else None)
                    if got is not None:
                        bandwidth = max(bandwidth or 0, got["bandwidth_gbs"])
                elif engine == "llama.cpp":
                    got = llama_cpp(work, src, pylib, dense, precision, args.prompt, args.steps,
                                    args.threads, py or sys.executable, params)
                else:
                    got = ctranslate2(work, pylib, dense, precision, args.prompt, args.steps,
                                      args.threads, py, params)
                if got is None:
                    continue
                got["seconds"] = round(time.time() - t0, 1)
                per = results["engines"].setdefault(engine, {})
                best = per.setdefault(precision, dict(got, rounds=[]))
                best["rounds"].append({"round": round_index,
                                       **{k: got[k] for k in ("decode", "prefill")}})
                best["decode"] = max(best["decode"], got["decode"])
                best["prefill"] = max(best["prefill"], got["prefill"])
    if bandwidth is None:
        bandwidth = measure_bandwidth(build)
    results["bandwidth_gbs"] = bandwidth
    for per in results["engines"].values():
        for got in per.values():
            got["roofline_fraction"] = got["decode"] * got["streamed_bytes"] / (bandwidth * 1e9)
    report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


def measure_bandwidth(build: Path) -> float:
    p = run([build / "benchmarks" / "engine_bench", "--bandwidth-only"], timeout=300,
            capture_output=True)
    return float(re.search(r"memory_bandwidth_gbs ([\d.]+)", p.stdout).group(1))


def report(results: dict) -> None:
    bw = results["bandwidth_gbs"]
    log(f"\n{results['shape']} shape, {results['threads']} threads, prompt {results['prompt']}, "
        f"{results['steps']} decode steps, best of {results['rounds']} round(s); DRAM read "
        f"bandwidth {bw:.1f} GB/s (the best probe)\n")
    log("| precision | engine | format | decode tok/s | GB/token | % of DRAM bw | "
        "prefill tok/s |")
    log("|---|---|---|---|---|---|---|")
    for precision in PRECISIONS:
        for engine, per in results["engines"].items():
            got = per.get(precision)
            if got is None:
                continue
            log(f"| {precision} | {engine} | {got['format']} | {got['decode']:.2f} | "
                f"{got['streamed_bytes'] / 1e9:.2f} | {100 * got['roofline_fraction']:.0f}% | "
                f"{got['prefill']:.1f} |")
    for mine in ("ours", "ours-int8act", "ours-nf4"):
        ours = results["engines"].get(mine, {})
        for engine, per in results["engines"].items():
            if engine.startswith("ours"):
                continue
            for phase in ("decode", "prefill"):
                ratios = [f"{p} {ours[p][phase] / per[p][phase]:.2f}x"
                          for p in PRECISIONS if p in per and p in ours]
                if ratios:
                    log(f"{mine} / {engine} {phase}: " + ", ".join(ratios))
                paired = [f"{p} {paired_ratio(ours[p], per[p], phase)}"
                          for p in PRECISIONS if p in per and p in ours
                          and len(ours[p]["rounds"]) > 1]
                if paired:
                    log("  paired by round (median, range): " + ", ".join(paired))


def paired_ratio(ours: dict, theirs: dict, phase: str) -> str:
    """The median and range of ours / theirs round by round: each round measured the two
    within minutes of each other, so a drift of the VM's bandwidth between rounds (2x within the
    hour here) moves both, where the best of each may come from different rounds."""
    theirs_by_round = {r["round"]: r for r in theirs["rounds"]}
    ratios = sorted(a[phase] / theirs_by_round[a["round"]][phase] for a in ours["rounds"]
                    if a["round"] in theirs_by_round)
    if not ratios:
        return "no round with both"
    return (f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}, "
            f"{len(ratios)} rounds)")


if __name__ == "__main__":
    sys.exit(main())

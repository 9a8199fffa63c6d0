#!/usr/bin/env python3
"""GPU benchmark: our server (the real launcher, router and shard) on a Llama-3-8B-shaped model
with random bf16 weights, against HF transformers on the same GPU in the same run.

Nothing is downloaded: the checkpoint (a HF Llama folder, ~16 GB of safetensors shards) is
written on the spot with numpy and cached in --model-dir; the tokenizer is the Llama-3-style
test fixture (its ids are all < 128256, so it works with the full-size vocabulary).

Reports, in one markdown table and a JSON file (--out):
  * batch-1 decode tokens/s (128-token prompt, 256 new tokens, decode part only) and its
    fraction of the HBM roofline: tok/s x weight bytes read per token (every weight but the
    embedding table) / HBM bandwidth measured in the same run (torch device-to-device copy);
  * time to first token for prompts of 128 and 2048 tokens (median of --ttft-runs);
  * output tokens/s with 1, 16, 64 and 256 concurrent streams of 1000 in / 1000 out through
    the public gRPC API, each level for --duration seconds, counting streamed tokens;
  * the same figures (batch 16 with fewer new tokens, see --hf-new-tokens) from HF
    transformers, when a python with torch (CUDA) and transformers is found, after our server
    has been stopped (so that both get the whole GPU).

    python3 benchmarks/gpu_bench.py                                   # H100: ~5-7 minutes
    python3 benchmarks/gpu_bench.py --levels 1,16 --duration 20 --no-hf
    python3 benchmarks/gpu_bench.py --tiny --device cpu --levels 1,4 --duration 5 \\
        --model-dir /tmp/tgis-bench-tiny                              # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import queue
import random
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
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

WORDS = ("the model server streams tokens to many clients while the batcher keeps every request "
         "moving through prefill and decode steps on the accelerator under a steady load of long "
         "prompts with random words from a small list").split()


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Checkpoint


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


def safetensors_header(tensors) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


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
                    off = 2 * int(rng.integers(0, pool_n))
                    while nbytes > 0:
                        chunk = pool_mv[off:off + nbytes]
                        f.write(chunk)
                        nbytes -= len(chunk)
                        off = 0
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


# ------------------------------------------------------------------------------------------
# Helpers: device, torch python


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


def run_result_script(py: str, script: str, args: list[str], timeout: float, what: str) -> dict:
    """Runs a python script that prints 'RESULT {json}' lines and merges them; on a timeout the
    script (its whole session) is killed and what it printed so far is kept."""
    results, tail, buf = {}, [], b""
    log(f"{what}: {py} (up to {timeout:.0f} s)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([py, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    timed_out = False

    def take(line: bytes):
        nonlocal tail
        text = line.decode(errors="replace").rstrip()
        if text.startswith("RESULT "):
            results.update(json.loads(text[7:]))
            log(f"  {what}: {text[7:]}")
        elif text.strip():
            tail = (tail + [text])[-40:]

    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(left, 1.0)):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.replace(b"\r", b"\n").split(b"\n")
                for line in lines:
                    take(line)
        take(buf)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rc = proc.wait()
        proc.stdout.close()
    if timed_out:
        results["error"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        results["error"] = f"exit {rc}: " + (tail[-1] if tail else "")
    if "error" in results:
        log(f"{what}: {results['error']}")
        if tail:
            print("\n".join("    " + t for t in tail[-20:]), flush=True)
    return results


# ------------------------------------------------------------------------------------------
# Our server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")
    except OSError:
        return False


class Server:
    """The real launcher in its own session; its children (which make their own process
    groups) are remembered so that close() can always take everything down."""

    def __init__(self, args, model_dir: Path, log_path: Path):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="tgis-gpu-bench-"))
        self.log_path = log_path
        self.children: set[int] = set()
        env = dict(os.environ)
        env.update({
            "MODEL_NAME": str(model_dir), "NUM_SHARD": "1", "DTYPE_STR": args.dtype,
            "TGIS_DEVICE": args.device, "GRPC_PORT": str(self.grpc_port),
            "PORT": str(self.http_port), "MASTER_PORT": str(free_port()),
            "SHARD_UDS_PATH": str(self.tmp / "shard"),
            "TERMINATION_LOG": str(self.tmp / "termination-log"),
            "MAX_SEQUENCE_LENGTH": str(args.max_sequence_length),
            "MAX_NEW_TOKENS": str(args.max_new_tokens), "MAX_BATCH_SIZE": str(args.max_batch_size),
            "MAX_CONCURRENT_REQUESTS": str(args.max_concurrent_requests),
            "SHUTDOWN_GRACE_PERIOD": "5", "SHARD_STARTUP_TIMEOUT": str(int(args.startup_timeout)),
        })
        if args.kv_cache_blocks:
            env["KV_CACHE_BLOCKS"] = str(args.kv_cache_blocks)
        launcher = Path(args.build_dir) / "launcher" / "text-generation-launcher"
        if not launcher.is_absolute():
            launcher = REPO / launcher
        if not launcher.exists():
            raise SystemExit(f"{launcher} is not built")
        self.env = {k: env[k] for k in ("MODEL_NAME", "DTYPE_STR", "TGIS_DEVICE",
                                        "MAX_SEQUENCE_LENGTH", "MAX_NEW_TOKENS", "MAX_BATCH_SIZE",
                                        "MAX_CONCURRENT_REQUESTS")}
        if "KV_CACHE_BLOCKS" in env:
            self.env["KV_CACHE_BLOCKS"] = env["KV_CACHE_BLOCKS"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(log_path, "wb")
        log(f"starting {launcher} (log: {log_path}) with " +
            " ".join(f"{k}={v}" for k, v in self.env.items()))
        self.proc = subprocess.Popen([str(launcher)], env=env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def _note_children(self) -> None:
        if self.proc.poll() is None:
            self.children.update(children_of(self.proc.pid))

    def http_get(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}",
                                        timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, ""
        except (OSError, ValueError):
            return 0, ""

    def wait_healthy(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            self._note_children()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited ({self.proc.returncode}) before /health "
                                   f"answered 200; its log ends with:\n{self.log_tail()}")
            if self.http_get("/health")[0] == 200:
                self._note_children()
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"/health did not answer 200 within {timeout:.0f} s; the launcher's "
                           f"log ends with:\n{self.log_tail()}")

    def metric(self, name: str) -> float | None:
        code, text = self.http_get("/metrics")
        if code != 200:
            return None
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                try:
                    return float(line.rsplit(" ", 1)[1])
                except ValueError:
                    return None
        return None

    def wait_idle(self, timeout: float) -> float | None:
        """Seconds until no request is running or queued (None: not within timeout)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.metric("tgi_batch_current_size") == 0 and self.metric("tgi_queue_size") == 0:
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    def close(self) -> None:
        self._note_children()
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=25)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # The launcher's children make their own process groups and die with it; any that did
        # not (still alive and still ours) are killed with their groups.
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.children:
            if pid_alive(pid) and "text-generation" in cmdline(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(pid_alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.log_file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# Measurements through the public gRPC API


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def words_for(tokens: int, tokens_per_word: float) -> int:
    """Words of random text that make comfortably more than `tokens` tokens."""
    return int(tokens / tokens_per_word * 1.25) + 16


def gen_request(pb, text: str, input_tokens: int, max_new: int, min_new: int):
    # generated_tokens: every token gets its own stream message. Without it the server (as
    # TGIS) sends none for a token whose text is empty, and most of this random model's tokens
    # are outside the small fixture tokenizer's vocabulary (empty text): tokens would arrive in
    # bursts, or all at the end.
    return pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text),
        params=pb.Parameters(method=pb.GREEDY, truncate_input_tokens=input_tokens,
                             response=pb.ResponseOptions(generated_tokens=True),
                             stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                          min_new_tokens=min_new)))


def stream_once(stub, pb, text: str, input_tokens: int, max_new: int, min_new: int,
                timeout: float) -> dict:
    """One GenerateStream: times of the first generated token and of the last one."""
    t0 = time.perf_counter()
    first = last = None
    first_count = count = 0
    input_count = None
    for msg in stub.GenerateStream(gen_request(pb, text, input_tokens, max_new, min_new),
                                   timeout=timeout):
        if msg.input_token_count:
            input_count = msg.input_token_count
        if msg.generated_token_count > count:
            now = time.perf_counter()
            if first is None:
                first, first_count = now, msg.generated_token_count
            last, count = now, msg.generated_token_count
    if first is None:
        raise RuntimeError("the stream ended without a generated token")
    return {"ttft_s": first - t0, "first_count": first_count, "decode_s": last - first,
            "generated": count, "input_tokens": input_count, "total_s": last - t0}


def measure_ttft(stub, pb, lengths, runs, tokens_per_word, timeout) -> dict:
    rng = random.Random(7)
    out = {}
    for n in lengths:
        samples, inputs = [], set()
        for _ in range(runs):
            r = stream_once(stub, pb, prompt_text(rng, words_for(n, tokens_per_word)), n, 1, 1,
                            timeout)
            samples.append(r["ttft_s"])
            inputs.add(r["input_tokens"])
        out[str(n)] = {"median_ms": statistics.median(samples) * 1e3,
                       "min_ms": min(samples) * 1e3, "runs": runs,
                       "input_tokens_seen": sorted(i for i in inputs if i is not None)}
        log(f"TTFT {n} tokens: median {out[str(n)]['median_ms']:.1f} ms "
            f"(min {out[str(n)]['min_ms']:.1f}, inputs {out[str(n)]['input_tokens_seen']})")
    return out


def measure_decode(stub, pb, prompt, new, runs, tokens_per_word, timeout) -> dict:
    rng = random.Random(11)
    rates, samples = [], []
    for _ in range(runs):
        r = stream_once(stub, pb, prompt_text(rng, words_for(prompt, tokens_per_word)), prompt,
                        new, new, timeout)
        if r["generated"] != new:
            raise RuntimeError(f"decode run generated {r['generated']} tokens, not {new}")
        if r["decode_s"] <= 0:
            raise RuntimeError("decode run: all tokens arrived in one message")
        rates.append((r["generated"] - r["first_count"]) / r["decode_s"])
        samples.append(r)
    res = {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
           "prompt_tokens": prompt, "new_tokens": new,
           "input_tokens_seen": samples[0]["input_tokens"]}
    log(f"batch-1 decode: {res['tokens_per_s']:.1f} tok/s (runs: "
        + ", ".join(f"{x:.1f}" for x in rates) + ")")
    return res


# One level of concurrent streams runs in several client processes (spawned, so that gRPC is
# never forked), each an asyncio loop with its share of the streams.

BUCKET_S = 0.1


def _level_client(stub_dir, target, streams, start_q, go, t0_value, duration, prompt_tokens,
                  prompt_words, new_tokens, seed, result_q):
    sys.path.insert(0, stub_dir)
    import grpc
    import generation_pb2 as pb
    import generation_pb2_grpc as pb_grpc

    async def run():
        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
        stub = pb_grpc.GenerationServiceStub(channel)
        await channel.channel_ready()
        start_q.put("ready")
        while not go.is_set():
            await asyncio.sleep(0.005)
        t0 = t0_value.value
        deadline = t0 + duration
        while time.monotonic() < t0:
            await asyncio.sleep(0.001)
        rng = random.Random(seed)
        buckets = [0] * (int(math.ceil(duration / BUCKET_S)) + 1)
        stats = {"started": 0, "completed": 0, "errors": 0, "error_samples": [], "ttft": [],
                 "input_tokens": set()}

        async def stream_loop():
            while time.monotonic() < deadline:
                req = gen_request(pb, prompt_text(rng, prompt_words), prompt_tokens, new_tokens,
                                  new_tokens)
                stats["started"] += 1
                start, seen = time.monotonic(), 0
                try:
                    call = stub.GenerateStream(req, timeout=deadline - start + 30)
                    async for msg in call:
                        now = time.monotonic()
                        if msg.input_token_count:
                            stats["input_tokens"].add(msg.input_token_count)
                        if msg.generated_token_count > seen:
                            if seen == 0:
                                stats["ttft"].append(now - start)
                            if now < deadline:
                                buckets[int((now - t0) / BUCKET_S)] += msg.generated_token_count - seen
                            seen = msg.generated_token_count
                    stats["completed"] += 1
                except grpc.aio.AioRpcError as e:
                    stats["errors"] += 1
                    if len(stats["error_samples"]) < 3:
                        stats["error_samples"].append(f"{e.code().name}: {e.details()}")
                    await asyncio.sleep(0.1)

        cpu0 = time.process_time()
        tasks = [asyncio.ensure_future(stream_loop()) for _ in range(streams)]
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in tasks:
            t.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
                stats["errors"] += 1
                if len(stats["error_samples"]) < 3:
                    stats["error_samples"].append(f"client: {r!r}")
        cpu = time.process_time() - cpu0
        await channel.close()
        stats["input_tokens"] = sorted(stats["input_tokens"])
        return {"buckets": buckets, "cpu_s": cpu, **stats}

    try:
        result_q.put(asyncio.run(run()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        start_q.put(f"error: {e!r}")
        result_q.put({"fatal": repr(e)})


def run_level(stub_dir, target, concurrency, duration, prompt_tokens, new_tokens,
              tokens_per_word, procs) -> dict:
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, concurrency))
    start_q, result_q = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    t0_value = ctx.Value("d", 0.0)
    share = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    workers = [ctx.Process(target=_level_client, daemon=True,
                           args=(stub_dir, target, n, start_q, go, t0_value, duration,
                                 prompt_tokens, words_for(prompt_tokens, tokens_per_word),
                                 new_tokens, 1000 * concurrency + i, result_q))
               for i, n in enumerate(share)]
    for w in workers:
        w.start()
    done = False
    try:
        for _ in workers:
            try:
                msg = start_q.get(timeout=60)
            except queue.Empty:
                raise RuntimeError("the client processes did not connect within 60 s") from None
            if msg != "ready":
                raise RuntimeError(f"a client process failed: {msg}")
        t0_value.value = time.monotonic() + 0.2
        go.set()
        results = [result_q.get(timeout=duration + 90) for _ in workers]
        done = True
    finally:
        for w in workers:
            w.join(timeout=10 if done else 0)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
    fatal = [r["fatal"] for r in results if "fatal" in r]
    if fatal:
        raise RuntimeError(f"client process failed: {fatal[0]}")
    n_buckets = len(results[0]["buckets"])
    buckets = [sum(r["buckets"][i] for r in results) for i in range(n_buckets)]
    total = sum(buckets)
    half = int(round(duration / 2 / BUCKET_S))
    ttft = sorted(t for r in results for t in r["ttft"])
    return {
        "concurrency": concurrency, "duration_s": duration, "client_processes": procs,
        "generated_tokens": total, "output_tokens_per_s": total / duration,
        "second_half_tokens_per_s": sum(buckets[half:]) / (duration - half * BUCKET_S),
        "requests_started": sum(r["started"] for r in results),
        "requests_completed": sum(r["completed"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "error_samples": [e for r in results for e in r["error_samples"]][:3],
        "streams_with_a_token": len(ttft),
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3 if ttft else None,
        "ttft_max_ms": ttft[-1] * 1e3 if ttft else None,
        "input_tokens_seen": sorted({i for r in results for i in r["input_tokens"]}),
        "client_cpu_fraction_max": max(r["cpu_s"] for r in results) / duration,
    }


def bench_server(args, model_dir: Path, results: dict) -> None:
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    import grpc
    from procs import proto_module

    pb, pb_grpc = proto_module("generation")
    import tgis_proto

    stub_dir = tgis_proto._stub_dir
    out_log = Path(args.out).with_name(Path(args.out).stem + "-launcher.log")
    server = Server(args, model_dir, out_log)
    ours = results["ours"]
    ours["server_env"] = server.env
    ours["launcher_log"] = str(out_log)
    try:
        ours["startup_s"] = round(server.wait_healthy(args.startup_timeout), 1)
        log(f"server healthy after {ours['startup_s']} s (gRPC {server.target})")
        channel = grpc.insecure_channel(server.target)
        stub = pb_grpc.GenerationServiceStub(channel)
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        ours["model_info"] = {"max_sequence_length": info.max_sequence_length,
                              "max_new_tokens": info.max_new_tokens}
        sample = prompt_text(random.Random(3), 400)
        count = stub.Tokenize(pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=sample)]), timeout=30).responses[0].token_count
        tpw = count / 400
        log(f"tokenizer: {tpw:.2f} tokens per prompt word")
        # Warm-up (not measured): a short prompt and a long one.
        rng = random.Random(5)
        for n in (16, max(args.ttft_lengths)):
            stream_once(stub, pb, prompt_text(rng, words_for(n, tpw)), n, 8, 8, args.rpc_timeout)

        def phase(name, fn):
            """Runs one measurement; a failure is recorded and the next one still runs
            (unless the launcher is gone)."""
            if server.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited ({server.proc.returncode}); its log "
                                   f"ends with:\n{server.log_tail()}")
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - reported, and the run goes on
                ours.setdefault("phase_errors", {})[name] = f"{type(e).__name__}: {e}"
                log(f"{name} failed: {type(e).__name__}: {e}")
                print("---- launcher log (tail) ----\n" + server.log_tail(30) + "\n----",
                      flush=True)
                return None

        ttft = phase("ttft", lambda: measure_ttft(stub, pb, args.ttft_lengths, args.ttft_runs,
                                                  tpw, args.rpc_timeout))
        if ttft:
            ours["ttft"] = ttft
        decode = phase("decode", lambda: measure_decode(
            stub, pb, args.decode_prompt, args.decode_tokens, args.decode_runs, tpw,
            args.rpc_timeout))
        if decode:
            ours["decode"] = decode
        channel.close()
        ours["levels"] = []
        for c in args.levels:
            procs = args.client_procs or max(1, min(math.ceil(c / 32), (os.cpu_count() or 2) // 2))
            log(f"level {c}: {c} streams of {args.level_prompt} in / {args.level_new} out for "
                f"{args.duration:.0f} s ({procs} client process(es))")
            row = phase(f"level {c}", lambda: run_level(
                stub_dir, server.target, c, args.duration, args.level_prompt, args.level_new,
                tpw, procs))
            if row is None:
                continue
            row["drain_s"] = server.wait_idle(args.drain_timeout)
            ours["levels"].append(row)
            log(f"level {c}: {row['output_tokens_per_s']:.1f} tok/s over the level "
                f"({row['second_half_tokens_per_s']:.1f} in its second half), "
                f"{row['requests_started']} started, {row['requests_completed']} completed, "
                f"{row['errors']} errors, TTFT p50 {fmt(row['ttft_p50_ms'], '.0f')} ms, "
                f"client CPU {row['client_cpu_fraction_max']:.0%}, drained in "
                f"{fmt(row['drain_s'], '.1f', 'NOT')} s")
            if row["errors"]:
                log(f"  errors: {row['error_samples']}")
            if row["drain_s"] is None:
                log(f"  the server still had requests {args.drain_timeout:.0f} s after the "
                    "clients cancelled theirs")
    except Exception as e:
        ours["error"] = f"{type(e).__name__}: {e}"
        log(f"our server: {ours['error']}")
        if "log ends with" not in str(e):
            print("---- launcher log (tail) ----\n" + server.log_tail() + "\n----", flush=True)
    finally:
        log("stopping our server")
        server.close()


# ------------------------------------------------------------------------------------------
# HF transformers


HF_SCRIPT = r'''
import inspect, json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
lengths = [int(x) for x in sys.argv[2].split(",")]
runs, dprompt, dnew = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
batch, bprompt, bnew = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
dev = sys.argv[9] if len(sys.argv) > 9 else "cuda"
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
t0 = time.perf_counter()
try:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, device_map=dev)
except Exception:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to(dev)
model.eval()
import transformers
emit(hf_load_s=time.perf_counter() - t0, transformers=transformers.__version__,
     torch=torch.__version__, attn_implementation=getattr(model.config, "_attn_implementation", None))
params = inspect.signature(model.forward).parameters
keep = {}
for k in ("logits_to_keep", "num_logits_to_keep"):
    if k in params:
        keep = {k: 1}
        break
g = torch.Generator(device="cpu").manual_seed(0)
vocab = min(model.config.vocab_size, 1500)
def ids(b, n):
    return torch.randint(0, vocab, (b, n), generator=g).to(dev)
eos = model.config.eos_token_id
@torch.inference_mode()
def first_token(x):
    sync(); t = time.perf_counter()
    out = model(input_ids=x, use_cache=True, **keep)
    out.logits[:, -1].argmax(-1).tolist()
    return time.perf_counter() - t
@torch.inference_mode()
def gen(x, new):
    sync(); t = time.perf_counter()
    y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=eos)
    sync()
    assert y.shape[1] - x.shape[1] == new, y.shape
    return time.perf_counter() - t
first_token(ids(1, 16)); gen(ids(1, 16), 8)  # warm-up
ttft = {}
for n in lengths:
    first_token(ids(1, n))
    s = [first_token(ids(1, n)) for _ in range(runs)]
    ttft[str(n)] = {"median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3, "runs": runs}
emit(ttft=ttft)
pre = statistics.median(first_token(ids(1, dprompt)) for _ in range(3))
total = gen(ids(1, dprompt), dnew)
emit(decode={"tokens_per_s": (dnew - 1) / (total - pre), "total_s": total, "prefill_s": pre,
             "prompt_tokens": dprompt, "new_tokens": dnew})
total = gen(ids(batch, bprompt), bnew)
emit(batch={"batch": batch, "prompt_tokens": bprompt, "new_tokens": bnew, "seconds": total,
            "output_tokens_per_s": batch * bnew / total})
if dev == "cuda":
    emit(max_memory_allocated_gb=torch.cuda.max_memory_allocated() / 1e9)
'''


# ------------------------------------------------------------------------------------------
# Report


def fmt(x, spec=".1f", none="n/a"):
    return none if x is None else format(x, spec)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def report(results: dict, args) -> str:
    ours, hf, bw = results["ours"], results.get("hf", {}), results.get("bandwidth", {})
    ck = results["checkpoint"]
    if ck.get("foreign"):
        title = f"{ck['weight_bytes'] / 2e9:.2f}B-parameter (if 16-bit) checkpoint {ck['folder']}"
    else:
        title = (f"{ck['parameters'] / 1e9:.2f}B-parameter Llama "
                 f"({'tiny' if args.tiny else 'Llama-3-8B shape'}, random bf16 weights)")
    if bw.get("hbm_bytes_per_s"):
        bw_text = (f"{bw['hbm_bytes_per_s'] / 1e9:.0f} GB/s (torch device-to-device copy of "
                   f"{bw['copy_bytes'] / 2**30:.0f} GiB, best of 10, this run)")
    else:
        bw_text = f"not measured ({bw.get('skipped', bw.get('error', '?'))})"
    if hf.get("transformers"):
        hf_text = (f"transformers {hf.get('transformers')}, torch {hf.get('torch')}, attention "
                   f"{hf.get('attn_implementation')}, loaded in {fmt(hf.get('hf_load_s'))} s")
    else:
        hf_text = f"not measured ({hf.get('skipped', hf.get('error', '?'))})"
    lines = [
        f"## GPU benchmark: {title}",
        "",
        f"- device: {results['device_name']} (TGIS_DEVICE={args.device}, DTYPE_STR={args.dtype})",
        f"- weights read per decoded token (all but the embedding table): "
        f"{ck['weight_bytes_per_token'] / 1e9:.3f} GB",
        f"- HBM bandwidth: {bw_text}",
        f"- HF transformers: {hf_text}",
    ]
    if ours.get("error"):
        lines.append(f"- OUR SERVER FAILED: {ours['error'].split('; its log')[0].splitlines()[0]} "
                     f"(log: {ours.get('launcher_log')})")
    for name, err in ours.get("phase_errors", {}).items():
        lines.append(f"- {name} FAILED: {err.splitlines()[0]}")
    if hf.get("error") and hf.get("transformers"):
        lines.append(f"- HF run incomplete: {hf['error']}")
    lines += ["", "| metric | ours | HF transformers | ours/HF |", "|---|---:|---:|---:|"]
    roof = None
    bpt = ck["weight_bytes_per_token"]
    d = ours.get("decode", {}).get("tokens_per_s")
    hd = hf.get("decode", {}).get("tokens_per_s")
    lines.append(f"| batch-1 decode tok/s ({args.decode_prompt} in, {args.decode_tokens} out, decode part) "
                 f"| {fmt(d)} | {fmt(hd)} | {fmt(ratio(d, hd), '.2f')} |")
    if bw.get("hbm_bytes_per_s"):
        roof = bw["hbm_bytes_per_s"] / bpt
        f_ours = d * bpt / bw["hbm_bytes_per_s"] if d else None
        f_hf = hd * bpt / bw["hbm_bytes_per_s"] if hd else None
        lines.append(f"| batch-1 decode, fraction of HBM roofline ({roof:.0f} tok/s) "
                     f"| {fmt(f_ours, '.1%')} | {fmt(f_hf, '.1%')} | {fmt(ratio(f_ours, f_hf), '.2f')} |")
    else:
        lines.append("| batch-1 decode, fraction of HBM roofline | skipped: no bandwidth "
                     "measured (see above) | | |")
    for n in args.ttft_lengths:
        a = ours.get("ttft", {}).get(str(n), {}).get("median_ms")
        b = hf.get("ttft", {}).get(str(n), {}).get("median_ms")
        lines.append(f"| TTFT ms, {n} input tokens (median of {args.ttft_runs}; lower is better) "
                     f"| {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b), '.2f')} |")
    hb = hf.get("batch", {})
    for row in ours.get("levels", []):
        c = row["concurrency"]
        b, note = None, ""
        if hb and c == hb.get("batch"):
            b = hb.get("output_tokens_per_s")
            note = f" (HF: batch {c}, {hb['prompt_tokens']} in / {hb['new_tokens']} out)"
        lines.append(f"| output tok/s, {c} concurrent, {args.level_prompt} in / {args.level_new} out, "
                     f"{args.duration:.0f} s{note} | {fmt(row['output_tokens_per_s'])} | {fmt(b)} "
                     f"| {fmt(ratio(row['output_tokens_per_s'], b), '.2f')} |")
    if hb and not any(r["concurrency"] == hb.get("batch") for r in ours.get("levels", [])):
        lines.append(f"| HF output tok/s, batch {hb['batch']}, {hb['prompt_tokens']} in / "
                     f"{hb['new_tokens']} out | | {fmt(hb.get('output_tokens_per_s'))} | |")
    if ours.get("levels"):
        lines += ["", "Levels in detail (ours):", "",
                  "| concurrent | tok/s (level) | tok/s (2nd half) | started | completed | errors "
                  "| TTFT p50 ms | TTFT max ms | input tokens | client CPU | drain s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for r in ours["levels"]:
            lines.append(
                f"| {r['concurrency']} | {r['output_tokens_per_s']:.1f} | {r['second_half_tokens_per_s']:.1f} "
                f"| {r['requests_started']} | {r['requests_completed']} | {r['errors']} "
                f"| {fmt(r['ttft_p50_ms'], '.0f')} | {fmt(r['ttft_max_ms'], '.0f')} "
                f"| {','.join(map(str, r['input_tokens_seen']))} | {r['client_cpu_fraction_max']:.0%} "
                f"| {fmt(r['drain_s'], '.1f', 'NOT DRAINED')} |")
    lines += ["",
              f"Ours is measured through the public gRPC API (tokenization, router, shard); HF is "
              f"the model alone in-process (TTFT: one forward of the prompt and an argmax; decode: "
              f"generate() minus prefill). HF's batch figure uses {args.hf_new_tokens} new tokens "
              f"(not {args.level_new}) to bound its time. Checkpoint "
              f"{'reused' if ck.get('reused') else 'written in %.0f s' % ck.get('write_seconds', 0)}; "
              f"our server was healthy after {fmt(ours.get('startup_s'))} s; total run "
              f"{results.get('total_s', 0):.0f} s."]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--model-dir", default=None,
                    help="checkpoint folder (default /tmp/tgis-bench-llama3-8b, or "
                         "/tmp/tgis-bench-tiny with --tiny); reused when complete")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model of the same architecture (hidden 256, 2 layers): for "
                         "testing this script, e.g. on a CPU with --device cpu")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"),
                    help="TGIS_DEVICE for the shard (default cuda)")
    ap.add_argument("--dtype", default="bfloat16", help="DTYPE_STR (default bfloat16)")
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--levels", type=ints, default=[1, 16, 64, 256],
                    help="concurrent streams per level (default 1,16,64,256)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per level (default 30)")
    ap.add_argument("--level-prompt", type=int, default=1000, help="input tokens per level request")
    ap.add_argument("--level-new", type=int, default=1000, help="new tokens per level request")
    ap.add_argument("--ttft-lengths", type=ints, default=[128, 2048])
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-runs", type=int, default=3)
    ap.add_argument("--max-sequence-length", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-concurrent-requests", type=int, default=512)
    ap.add_argument("--kv-cache-blocks", type=int, default=0,
                    help="KV_CACHE_BLOCKS (default: the shard sizes it from free memory; with "
                         "--tiny: enough for the largest level)")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes per level (default: one per 32 streams, at most "
                         "half the cores)")
    ap.add_argument("--startup-timeout", type=float, default=420.0,
                    help="seconds for the server to become healthy")
    ap.add_argument("--rpc-timeout", type=float, default=120.0, help="seconds per measured RPC")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds to wait for the server to go idle after a level")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--hf-python", help="python with torch (CUDA) and transformers")
    ap.add_argument("--hf-timeout", type=float, default=240.0, help="seconds for the HF run")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-new-tokens", type=int, default=200,
                    help="new tokens per sequence in HF's batch run (default 200)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_bench.json"))
    args = ap.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = "/tmp/tgis-bench-tiny" if args.tiny else "/tmp/tgis-bench-llama3-8b"
    need = max([*args.ttft_lengths, args.decode_prompt + args.decode_tokens,
                args.level_prompt + args.level_new])
    if args.max_sequence_length <= need:
        ap.error(f"--max-sequence-length must exceed {need}")
    if max(args.level_new, args.decode_tokens) > args.max_new_tokens:
        ap.error("--max-new-tokens is smaller than --level-new or --decode-tokens")
    if args.tiny and not args.kv_cache_blocks:
        args.kv_cache_blocks = math.ceil(
            max(args.levels + [1]) * (args.level_prompt + args.level_new) / 16) + 64
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so that the launcher is always stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    results = {"args": vars(args), "device_name": device_name(args.device), "ours": {},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    log(f"device: {results['device_name']}")
    model_dir = Path(args.model_dir)
    results["checkpoint"] = make_checkpoint(model_dir, TINY if args.tiny else LLAMA3_8B)

    torch_py, why = (None, f"--device {args.device}") if args.device == "cpu" else \
        find_torch_python(args.hf_python)
    results["torch_python"] = {"python": torch_py, "info": why}
    if torch_py:
        results["bandwidth"] = run_result_script(torch_py, BANDWIDTH_SCRIPT, [], 120,
                                                 "HBM bandwidth")
    else:
        results["bandwidth"] = {"skipped": f"no torch with CUDA: {why}"}
        log(f"HBM bandwidth: skipped ({why})")

    bench_server(args, model_dir, results)

    if args.no_hf:
        results["hf"] = {"skipped": "--no-hf"}
    elif not torch_py:
        results["hf"] = {"skipped": f"no torch with CUDA: {why}"}
    elif not why.get("transformers"):
        results["hf"] = {"skipped": f"{torch_py} has no transformers"}
    else:
        results["hf"] = run_result_script(
            torch_py, HF_SCRIPT,
            [str(model_dir), ",".join(map(str, args.ttft_lengths)), str(args.ttft_runs),
             str(args.decode_prompt), str(args.decode_tokens), str(args.hf_batch),
             str(args.level_prompt), str(args.hf_new_tokens)],
            args.hf_timeout, "HF transformers")
    if "skipped" in results["hf"]:
        log(f"HF transformers: skipped ({results['hf']['skipped']})")

    results["total_s"] = time.monotonic() - t_start
    table = report(results, args)
    results["table_markdown"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print("\n" + table + "\n", flush=True)
    log(f"wrote {out}")
    return 1 if results["ours"].get("error") or results["ours"].get("phase_errors") else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"[gpu_bench] interrupted ({e or 'Ctrl-C'}); the launcher, if started, was stopped",
              file=sys.stderr)
        sys.exit(130)

"""The reference: the same figures from HF transformers (bf16, on the same GPU, after our server
has stopped), in the torch python."""

from __future__ import annotations

from pathlib import Path

from .result_script import run_result_script

HF_SCRIPT = r'''
import inspect, json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
lengths = [int(x) for x in sys.argv[2].split(",")]
runs, dprompt, dnew = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
batch, bprompt, bnew = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
dev = sys.argv[9] if len(sys.argv) > 9 else "cuda"
compile_decode = (sys.argv[10] if len(sys.argv) > 10 else "1") == "1"
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
# The fast way to run a model in PyTorch (gpt-fast): a static KV cache and the forward under
# torch.compile (CUDA graphs by mode="reduce-overhead"). Last, because the compiled forward
# stays; its compile time is reported, and a failure is reported, not fatal.
if dev == "cuda" and hasattr(torch, "compile") and compile_decode:
    try:
        t1 = time.perf_counter()
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        for _ in range(2):
            gen(ids(1, dprompt), 16)  # compiles prefill and decode, then a warm run
        compile_s = time.perf_counter() - t1
        one = statistics.median(gen(ids(1, dprompt), 1) for _ in range(3))
        total = gen(ids(1, dprompt), dnew)
        emit(decode_compiled={"tokens_per_s": (dnew - 1) / (total - one), "total_s": total,
                              "prefill_s": one, "compile_s": compile_s})
    except Exception as e:  # noqa: BLE001 (any failure of the optional anchor)
        emit(decode_compiled={"error": f"{type(e).__name__}: {e}"[:400]})
'''


def run_hf(torch_py: str, model_dir: Path, args) -> dict:
    return run_result_script(
        torch_py, HF_SCRIPT,
        [str(model_dir), ",".join(map(str, args.ttft_lengths)), str(args.ttft_runs),
         str(args.decode_prompt), str(args.decode_tokens), str(args.hf_batch),
         str(args.level_prompt), str(args.hf_new_tokens), "cuda",
         "0" if getattr(args, "no_hf_compile", False) else "1"],
        args.hf_timeout, "HF transformers")

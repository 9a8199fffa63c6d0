"""The pieces of benchmarks/gpu_bench.py (its docstring says what it measures), one concern per
module:

  common        repository root, logging, number formatting
  checkpoint    the random Llama-3-8B-shaped safetensors checkpoint and its tokenizer copy
  device        what the device is called, and which python has torch with CUDA
  result_script a python script in a subprocess, reporting through 'RESULT {json}' lines
  bandwidth     the HBM bandwidth, measured with torch
  server        the real launcher: start, /health, /metrics, stop with all its processes
  measure       prompts, single streams, TTFT and batch-1 decode
  levels        output tokens/s with many concurrent streams from client processes
  ours          our server's whole run: start, warm up, every measurement, stop
  hf_reference  the same figures from HF transformers, in a subprocess
  report        the markdown table
  cli           the options and the order of the steps
"""

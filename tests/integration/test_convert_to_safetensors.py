"""`text-generation-server convert-to-safetensors` and the launcher's automatic conversion of a
.bin-only model, against the real binaries. Oracles: the `safetensors` package (a real decoder
of what we write) and transformers' own safetensors for the same weights; served outputs must be
transformers' golden greedy continuations (tests/fixtures/models/llama/golden.json)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402
from router_harness import Oracle  # noqa: E402

BINS = FIXTURES / "bin_checkpoints"
SERVER = "server/text-generation-server"
np = pytest.importorskip("numpy")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


def convert(model: str, env: dict | None = None) -> subprocess.CompletedProcess:
    need_binaries()
    return subprocess.run([str(binary(SERVER)), "convert-to-safetensors", model],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def copy(name: str, tmp_path):
    dst = tmp_path / name
    shutil.copytree(BINS / name, dst)
    return dst


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert np.array_equal(got[k], want[k]), k


def test_converted_file_reads_back_with_the_safetensors_library(tmp_path):
    model = copy("llama", tmp_path)
    r = convert(str(model))
    assert r.returncode == 0, r.stderr
    assert_same(safetensors_numpy.load_file(model / "model.safetensors"),
                safetensors_numpy.load_file(FIXTURES / "models" / "llama" / "model.safetensors"))


def test_tied_weights_metadata_names_the_kept_tensor(tmp_path):
    from safetensors import safe_open

    model = copy("tied", tmp_path)
    r = convert(str(model))
    assert r.returncode == 0, r.stderr
    assert_same(safetensors_numpy.load_file(model / "model.safetensors"),
                safetensors_numpy.load_file(model / "reference.safetensors"))
    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "lm_head.weight": "model.embed_tokens.weight"}


def test_second_run_leaves_existing_files_alone(tmp_path):
    model = copy("llama", tmp_path)
    assert convert(str(model)).returncode == 0
    before = (model / "model.safetensors").stat().st_mtime_ns
    r = convert(str(model))
    assert r.returncode == 0
    assert "existing .safetensors weights found" in r.stderr
    assert (model / "model.safetensors").stat().st_mtime_ns == before


def test_model_id_resolves_through_the_cache(tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--tiny--bin" / "snapshots" / ("a" * 40)
    shutil.copytree(BINS / "llama", snap)
    (cache / "models--tiny--bin" / "refs").mkdir()
    (cache / "models--tiny--bin" / "refs" / "main").write_text("a" * 40)
    r = convert("tiny/bin", {"HF_HUB_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert (snap / "model.safetensors").is_file()


def test_hostile_pickle_fails_naming_file_and_global(tmp_path):
    shutil.copy(FIXTURES / "torch_files" / "bad_global.pt", tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    r = convert(str(tmp_path))
    assert r.returncode != 0
    assert "pytorch_model.bin" in r.stderr and "posix.system" in r.stderr
    assert not (tmp_path / "model.safetensors").exists()


def test_launcher_converts_a_bin_only_model_and_serves_transformers_outputs(tmp_path):
    need_binaries()
    model = copy("llama_shards", tmp_path)
    grpc_port = free_port()
    env = {"MODEL_NAME": str(model), "GRPC_PORT": str(grpc_port), "PORT": str(free_port()),
           "SHARD_UDS_PATH": str(tmp_path / "shard"), "KV_CACHE_BLOCKS": "64",
           "TERMINATION_LOG": str(tmp_path / "termination-log"),
           "TGIS_PROGRESS_INTERVAL": "0"}  # a progress line at every step of the load
    launcher = Process([binary("launcher/text-generation-launcher")], env=env)
    try:
        _, pb, stub = wait_serving(launcher, grpc_port, 120)
        assert (model / "model.safetensors.index.json").is_file()
        out = launcher.output()
        assert "converting them to safetensors" in out
        # Progress lines: the conversion's and the load's closing lines.
        assert f"convert {model}: done, 2 files" in out
        assert "loading weights (2 files) from " in out
        assert re.search(r"loading weights \(2 files\) from \S+: [0-9.]+ \S+ of [0-9.]+ \S+ \(\d+%\)",
                         out), out
        # The shard says how its CPU kernels run: our AVX-512 GEMM for prefill, or OpenBLAS and
        # its kernel family.
        assert re.search(r"CPU kernels: linear isa \S+, \d+ threads, "
                         r"prefill GEMM (avx512|OpenBLAS \w+)", out), out
        oracle = Oracle("llama")
        responses = stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=p["text"]) for p in oracle.prompts],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=8))),
            timeout=60).responses
        assert [r.text for r in responses] == [oracle.text(i, 8) for i in range(len(oracle.prompts))]
    finally:
        launcher.close()

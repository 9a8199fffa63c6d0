"""The shard process (text-generation-server) through a real gRPC client on a unix socket,
using proto/generate.proto as the router does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, proto_module  # noqa: E402

grpc = pytest.importorskip("grpc")
MODEL = FIXTURES / "models" / "llama"


def golden(model: Path):
    return json.loads((model / "golden.json").read_text())["prompts"]


# Every test runs with steps run ahead (StepAhead: the shard decodes the next token while the
# client handles the last) and without: what a client sees must not differ.
@pytest.fixture(scope="module", params=["false", "true"], ids=["step-by-step", "decode-ahead"])
def shard(request):
    server = binary("server/text-generation-server")
    if not server.exists():
        pytest.skip(f"{server} not built")
    if not (MODEL / "golden.json").exists():
        pytest.skip("no model fixtures")
    pb, pb_grpc = proto_module("generate")
    tmp = tempfile.mkdtemp(prefix="tgis-shard-")
    uds = os.path.join(tmp, "shard")
    proc = Process([server, "serve", MODEL, "--uds-path", uds, "--kv-cache-blocks", "64",
                    "--block_size", "4", "--decode-ahead", request.param])
    proc.wait_for(lambda: os.path.exists(uds + "-0"), what="listening")
    channel = grpc.insecure_channel(f"unix://{uds}-0")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.TextGenerationServiceStub(channel)
    yield pb, stub, proc
    channel.close()
    proc.close()


def request(pb, rid, ids, max_new=16, **params):
    return pb.Request(id=rid, input_ids=ids, max_new_tokens=max_new,
                      parameters=pb.SamplingParameters(**params))


def test_info_health_warmup(shard):
    pb, stub, _ = shard
    info = stub.Info(pb.InfoRequest())
    config = json.loads((MODEL / "config.json").read_text())
    assert info.model_type == "llama"
    assert info.vocab_size == config["vocab_size"]
    assert info.device == "cpu"
    assert info.dtype == "float32"  # the dtype a CPU shard picks when none is given
    assert info.max_position_embeddings == config["max_position_embeddings"]
    assert len(info.eos_token_ids) >= 1
    stub.Health(pb.HealthRequest())
    warm = stub.Warmup(pb.WarmupRequest(max_input_length=32, max_batch_size=4))
    assert warm.num_blocks == 64 and warm.block_size == 4
    assert warm.max_supported_total_tokens == 256
    disc = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert len(disc.urls) == 1 and disc.urls[0].startswith("unix://")


def test_greedy_generation_matches_transformers(shard):
    pb, stub, _ = shard
    prompts = golden(MODEL)
    batch = pb.Batch(id=1, requests=[request(pb, i, p["input_ids"], len(p["generated_ids"]))
                                     for i, p in enumerate(prompts)])
    resp = stub.Prefill(pb.PrefillRequest(batch=batch))
    assert not resp.errors
    got = {i: [] for i in range(len(prompts))}
    cached = resp.batch
    gens = resp.generations
    while True:
        finished = []
        for g in gens:
            got[g.request_id].append(g.token.token_id)
            if len(got[g.request_id]) == len(prompts[g.request_id]["generated_ids"]):
                finished.append(g.request_id)
        alive = [i for i in cached.request_ids if i not in finished]
        if not alive:
            stub.ClearCache(pb.ClearCacheRequest(id=cached.id))
            break
        resp = stub.Decode(pb.DecodeRequest(batches=[cached], finished_request_ids=finished))
        assert not resp.errors
        cached, gens = resp.batch, resp.generations
    for i, p in enumerate(prompts):
        assert got[i] == p["generated_ids"], f"prompt {i}"


def test_bad_request_fails_alone(shard):
    pb, stub, _ = shard
    prompts = golden(MODEL)
    good = prompts[1]["input_ids"]
    batch = pb.Batch(id=2, requests=[request(pb, 10, [10**6]), request(pb, 11, good, 4),
                                     request(pb, 12, [])])
    resp = stub.Prefill(pb.PrefillRequest(batch=batch))
    codes = {e.request_id: e.code for e in resp.errors}
    assert codes == {10: grpc.StatusCode.INVALID_ARGUMENT.value[0],
                     12: grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    assert [g.request_id for g in resp.generations] == [11]
    assert resp.generations[0].token.token_id == prompts[1]["generated_ids"][0]
    assert list(resp.batch.request_ids) == [11]
    stub.ClearCache(pb.ClearCacheRequest(id=2))


def test_out_of_blocks_is_reported(shard):
    pb, stub, _ = shard
    too_long = [1] * (64 * 4 + 1)  # more tokens than the whole cache
    resp = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=3, requests=[
        request(pb, 20, too_long, 1)])))
    # Either the positions or the blocks run out first; both are per-request errors.
    assert len(resp.errors) == 1 and not resp.generations
    assert not resp.HasField("batch")


def test_filter_and_unknown_batch(shard):
    pb, stub, _ = shard
    prompts = golden(MODEL)
    batch = pb.Batch(id=4, requests=[request(pb, 30, prompts[0]["input_ids"], 4),
                                     request(pb, 31, prompts[1]["input_ids"], 4)])
    resp = stub.Prefill(pb.PrefillRequest(batch=batch))
    filtered = stub.FilterBatch(pb.FilterBatchRequest(batch_id=4, request_ids=[31]))
    assert list(filtered.batch.request_ids) == [31]
    resp = stub.Decode(pb.DecodeRequest(batches=[filtered.batch]))
    assert [g.request_id for g in resp.generations] == [31]
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=999)]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    stub.ClearCache(pb.ClearCacheRequest())


def test_seeded_sampling_is_reproducible_whatever_the_batch(shard):
    pb, stub, _ = shard
    prompts = golden(MODEL)
    params = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, seed=1234)

    def run(batch_id, extra):
        reqs = [request(pb, 1000 + batch_id, prompts[2]["input_ids"], 8, **params)] + extra
        resp = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=reqs)))
        ids = [g.token.token_id for g in resp.generations if g.request_id == 1000 + batch_id]
        cached = resp.batch
        for _ in range(7):
            resp = stub.Decode(pb.DecodeRequest(batches=[cached]))
            ids += [g.token.token_id for g in resp.generations if g.request_id == 1000 + batch_id]
            cached = resp.batch
        stub.ClearCache(pb.ClearCacheRequest(id=batch_id))
        return ids

    alone = run(50, [])
    crowded = run(51, [request(pb, 2000, prompts[0]["input_ids"], 8, do_sample=True, seed=7),
                       request(pb, 2001, prompts[1]["input_ids"], 8)])
    assert alone == crowded
    assert len(alone) == 8


def test_requests_joining_and_leaving_keep_their_tokens(shard):
    """What the router does between steps: a batch joins mid-way, one request is finished
    early (as a stop sequence would), another is filtered out. With decode-ahead, the shard has
    by then decoded a token the router never asks for; the rest must not notice."""
    pb, stub, _ = shard
    prompts = golden(MODEL)
    want = {700 + i: p["generated_ids"] for i, p in enumerate(prompts)}
    prompt_len = {700 + i: len(p["input_ids"]) for i, p in enumerate(prompts)}
    got = {rid: [] for rid in want}

    def take(resp):
        assert not resp.errors
        for g in resp.generations:
            got[g.request_id].append(g.token.token_id)
        return resp.batch

    first = take(stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=70, requests=[
        request(pb, 700, prompts[0]["input_ids"]), request(pb, 701, prompts[1]["input_ids"])]))))
    for _ in range(2):
        first = take(stub.Decode(pb.DecodeRequest(batches=[first])))
    second = take(stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=71, requests=[
        request(pb, 702, prompts[2]["input_ids"]), request(pb, 703, prompts[3]["input_ids"])]))))
    merged = take(stub.Decode(pb.DecodeRequest(batches=[first, second])))
    # 701 stops here, as a stop sequence would end it: its next token is never asked for.
    merged = take(stub.Decode(pb.DecodeRequest(batches=[merged], finished_request_ids=[701])))
    assert 701 not in merged.request_ids
    # 703 leaves through FilterBatch; the batch's token count is what the client was given.
    merged = stub.FilterBatch(pb.FilterBatchRequest(batch_id=merged.id,
                                                    request_ids=[700, 702])).batch
    assert merged.total_tokens == sum(prompt_len[r] + len(got[r]) for r in (700, 702))
    while len(got[700]) < 16:
        merged = take(stub.Decode(pb.DecodeRequest(batches=[merged])))
    stub.ClearCache(pb.ClearCacheRequest())
    assert got[700] == want[700]
    assert got[702] == want[702][:len(got[702])] and len(got[702]) == 14
    assert got[701] == want[701][:4]
    assert got[703] == want[703][:3]


def test_bad_model_dir_fails_at_start_naming_the_file(tmp_path):
    server = binary("server/text-generation-server")
    if not server.exists():
        pytest.skip(f"{server} not built")
    (tmp_path / "config.json").write_text("{not json")
    proc = Process([server, "serve", tmp_path, "--uds-path", str(tmp_path / "s")])
    rc = proc.proc.wait(timeout=30)
    assert rc != 0
    assert "config.json" in proc.output()


def gpu_visible() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: this build has no CUDA or no GPU is visible"),
    ("tpu", "--device must be cpu, cuda or auto, not 'tpu'"),
])
def test_unusable_device_fails_at_start_saying_why(tmp_path, device, message):
    server = binary("server/text-generation-server")
    if not server.exists():
        pytest.skip(f"{server} not built")
    if device == "cuda" and gpu_visible():
        pytest.skip("a GPU is visible here: --device cuda is usable")
    proc = Process([server, "serve", MODEL, "--uds-path", str(tmp_path / "s"), "--device", device])
    rc = proc.proc.wait(timeout=30)
    assert rc != 0
    assert message in proc.output()


def test_recurrent_states_are_set_aside_before_the_kv_cache(tmp_path):
    """A Mamba-2 model's per-sequence states for the router's max_batch_size come out of the
    memory before the KV cache is sized; more than the memory holds is refused at Warmup,
    naming the flag, and a Warmup within it then succeeds."""
    server = binary("server/text-generation-server")
    if not server.exists():
        pytest.skip(f"{server} not built")
    model = FIXTURES / "models" / "granite4_h"
    if not (model / "config.json").exists():
        pytest.skip("no model fixtures")
    pb, pb_grpc = proto_module("generate")
    uds = str(tmp_path / "shard")
    proc = Process([server, "serve", model, "--uds-path", uds, "--block_size", "4"])
    try:
        proc.wait_for(lambda: os.path.exists(uds + "-0"), what="listening")
        with grpc.insecure_channel(f"unix://{uds}-0") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = pb_grpc.TextGenerationServiceStub(channel)
            # ~10 KiB of states a sequence (the fixture's one Mamba-2 layer) times 2^32 - 1.
            with pytest.raises(grpc.RpcError) as err:
                stub.Warmup(pb.WarmupRequest(max_input_length=16, max_batch_size=2**32 - 1))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "recurrent (Mamba-2) states of 4294967295 sequences" in err.value.details()
            assert "lower MAX_BATCH_SIZE" in err.value.details()
            warm = stub.Warmup(pb.WarmupRequest(max_input_length=16, max_batch_size=4))
            assert warm.num_blocks > 0
        assert "recurrent states: 4 sequences of " in proc.output()
    finally:
        proc.close()

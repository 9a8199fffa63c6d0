"""Our server's part of the benchmark: start the launcher, warm up, run every measurement (a
failed one is recorded and the rest still run), stop it."""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

from .common import REPO, fmt, log
from .levels import run_level
from .measure import measure_decode, measure_ttft, prompt_text, stream_once, words_for
from .server import Server


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

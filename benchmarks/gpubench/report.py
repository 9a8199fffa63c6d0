"""The markdown table: ours, HF transformers and ours/HF, then the levels in detail."""

from __future__ import annotations

from .common import fmt


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
        f"- device: {results['device_name']} (TGIS_DEVICE={args.device}, DTYPE_STR={args.dtype}"
        f"{', QUANTIZE=' + args.quantize if getattr(args, 'quantize', None) else ''})",
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
    dc = hf.get("decode_compiled", {})
    if dc.get("tokens_per_s") or dc.get("error"):
        hc = dc.get("tokens_per_s")
        what = fmt(hc) if hc else "failed: " + dc["error"].splitlines()[0][:80]
        lines.append(f"| batch-1 decode tok/s, HF with a static cache + torch.compile "
                     f"(compiled in {fmt(dc.get('compile_s'))} s) | {fmt(d)} | {what} | "
                     f"{fmt(ratio(d, hc), '.2f')} |")
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


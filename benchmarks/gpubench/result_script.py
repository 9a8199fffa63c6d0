"""Runs a python script in a subprocess (the torch python, not this one) that reports through
'RESULT {json}' lines, under a time limit."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time

from .common import log


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

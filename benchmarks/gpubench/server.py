"""Our server for the benchmark: the real text-generation-launcher on free ports, its /health and
/metrics, and stopping it with every process it started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .common import REPO, log

sys.path.insert(0, str(REPO / "tests" / "integration"))
from procs import alive as pid_alive  # noqa: E402
from procs import children_of, cmdline, free_port  # noqa: E402


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
        if getattr(args, "quantize", None):
            env["QUANTIZE"] = args.quantize
        launcher = Path(args.build_dir) / "launcher" / "text-generation-launcher"
        if not launcher.is_absolute():
            launcher = REPO / launcher
        if not launcher.exists():
            raise SystemExit(f"{launcher} is not built")
        self.env = {k: env[k] for k in ("MODEL_NAME", "DTYPE_STR", "TGIS_DEVICE",
                                        "MAX_SEQUENCE_LENGTH", "MAX_NEW_TOKENS", "MAX_BATCH_SIZE",
                                        "MAX_CONCURRENT_REQUESTS")}
        for key in ("KV_CACHE_BLOCKS", "QUANTIZE"):
            if key in env:
                self.env[key] = env[key]
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

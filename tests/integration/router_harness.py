"""Starts a real shard (text-generation-server) and router (text-generation-router) on a fixture
model and gives tests a client generated from the public proto/generation.proto; plus the HF
oracle for what the router should answer (golden.json ids decoded with HF `tokenizers`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from functools import cached_property
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import FIXTURES, Process, binary, free_port, proto_module  # noqa: E402

SHARD_BINARY = "server/text-generation-server"
ROUTER_BINARY = "router/text-generation-router"


def binaries_missing() -> str | None:
    for b in (SHARD_BINARY, ROUTER_BINARY):
        if not binary(b).exists():
            return f"{binary(b)} not built"
    return None


class RouterServer:
    """A shard and a router in front of it. `router_args` are extra router flags (dashed TGIS
    names), `shard_args` extra shard flags; `env` extra environment for the router. /health and /metrics are on `http_port`.
    With `credentials` (grpc.ChannelCredentials) the client channel uses TLS, with
    `tls_target` as the name the server certificate must carry."""

    def __init__(self, model: str = "llama", router_args: list[str] | None = None,
                 env: dict | None = None, kv_blocks: int = 128, block_size: int = 4,
                 num_shard: int = 1, credentials=None, tls_target: str = "localhost",
                 shard_args: list[str] | None = None):
        import grpc

        self.model_dir = FIXTURES / "models" / model
        self.pb, self.pb_grpc = proto_module("generation")
        self.tmp = tempfile.mkdtemp(prefix="tgis-router-")
        self.uds = os.path.join(self.tmp, "shard")
        self.port = free_port()
        self.http_port = free_port()
        # With num_shard > 1, independent single-shard servers at <uds>-0, -1, ...: the router
        # calls every one of them and uses shard 0's answers.
        self.shards = [Process([binary(SHARD_BINARY), "serve", self.model_dir, "--uds-path", self.uds,
                                "--rank", str(rank), "--kv-cache-blocks", str(kv_blocks),
                                "--block-size", str(block_size), *(shard_args or [])])
                       for rank in range(num_shard)]
        self.shard = self.shards[0]
        self.router = None
        try:
            self.router = Process([binary(ROUTER_BINARY), "--tokenizer-path", self.model_dir,
                                   "--shard-uds-path", self.uds, "--grpc-port", str(self.port),
                                   "--num-shard", str(num_shard), "--shard-connect-timeout", "60",
                                   "--port", str(self.http_port), *(router_args or [])],
                                  env=env)
            self.router.wait_for(lambda: "gRPC server listening" in self.router.output(),
                                 timeout=60, what="listening")
            self.credentials, self.tls_target = credentials, tls_target
            self.channel = self._new_channel()
            grpc.channel_ready_future(self.channel).result(timeout=30)
        except Exception:
            self.close()
            raise
        self.stub = self.pb_grpc.GenerationServiceStub(self.channel)

    def _new_channel(self):
        import grpc

        if self.credentials is None:
            return grpc.insecure_channel(f"localhost:{self.port}")
        return grpc.secure_channel(f"localhost:{self.port}", self.credentials,
                                   options=[("grpc.ssl_target_name_override", self.tls_target)])

    def new_stub(self):
        channel = self._new_channel()
        return channel, self.pb_grpc.GenerationServiceStub(channel)

    def http_get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        """GET http://localhost:<http_port><path>: (status, body)."""
        return http_get(self.http_port, path, timeout)

    def log(self) -> str:
        return self.router.output() if self.router else ""

    def close(self):
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.router is not None:
            self.router.close()
        for shard in self.shards:
            shard.close()


@contextlib.contextmanager
def with_and_without(model: str, router_args: list[str]):
    """A router + shard with `router_args` and a plain one on the same model, and its Oracle:
    (feature, plain, oracle), for tests that a feature leaves outputs as they were."""
    feature = RouterServer(model, router_args=router_args)
    try:
        plain = RouterServer(model)
        try:
            yield feature, plain, Oracle(model)
        finally:
            plain.close()
    finally:
        feature.close()


class Oracle:
    """What HF says for a fixture model: golden greedy continuations and tokenization."""

    def __init__(self, model: str = "llama"):
        from tokenizers import Tokenizer

        self.model_dir = FIXTURES / "models" / model
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.prompts = json.loads((self.model_dir / "golden.json").read_text())["prompts"]
        # TGIS decodes generated tokens as a continuation: after a placeholder token.
        self.placeholder = self.tokenizer.encode("A", add_special_tokens=False).ids[:1]

    def continuation(self, generated: list[int]) -> str:
        before = self.tokenizer.decode(self.placeholder, skip_special_tokens=True)
        text = self.tokenizer.decode(self.placeholder + list(generated), skip_special_tokens=True)
        assert text.startswith(before)
        # Bytes left incomplete at the very end are dropped, as TGIS does.
        return text[len(before):].rstrip("\ufffd")

    def text(self, prompt: int, n: int) -> str:
        return self.continuation(self.prompts[prompt]["generated_ids"][:n])

    def tokens(self, prompt: int, n: int) -> list[str]:
        return [self.tokenizer.id_to_token(i) for i in self.prompts[prompt]["generated_ids"][:n]]

    @cached_property
    def eos_ids(self) -> list[int]:
        config = json.loads((self.model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        return eos if isinstance(eos, list) else [eos]


def http_get(port: int, path: str, timeout: float = 30.0) -> tuple[int, str]:
    """GET http://127.0.0.1:<port><path>: (status, body); status 0 when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError) as e:  # nobody listens (yet)
        return 0, str(e)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def fixture_model_dir(model: str) -> Path:
    return FIXTURES / "models" / model

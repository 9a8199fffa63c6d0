"""TLS and mTLS on the router's gRPC port (TLS_CERT_PATH, TLS_KEY_PATH, TLS_CLIENT_CA_CERT_PATH),
with a CA, server and client certificates made by the openssl CLI at test time, plus a second CA
whose certificates the server must refuse. Bad files fail the router at start, naming the file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import binary  # noqa: E402
from router_harness import ROUTER_BINARY, RouterServer, binaries_missing, fixture_model_dir  # noqa: E402

grpc = pytest.importorskip("grpc")

if shutil.which("openssl") is None:
    pytest.skip("the openssl CLI is needed to make test certificates", allow_module_level=True)


def openssl(*args: str, cwd: Path):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN={name}", "-days", "2",
            cwd=d)


def make_leaf(d: Path, name: str, ca: str, usage: str, san: str | None = None):
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n"
    if san:
        ext += f"subjectAltName={san}\n"
    (d / f"{name}.ext").write_text(ext)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
            cwd=d)


class Certs:
    def __init__(self, d: Path):
        self.dir = d
        make_ca(d, "ca")
        make_ca(d, "other-ca")
        make_leaf(d, "server", "ca", "serverAuth", "DNS:localhost,IP:127.0.0.1")
        make_leaf(d, "client", "ca", "clientAuth")
        make_leaf(d, "intruder", "other-ca", "clientAuth")

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def credentials(self, client: str | None = None, trust: str = "ca"):
        if client is None:
            return grpc.ssl_channel_credentials(root_certificates=self.read(f"{trust}.crt"))
        return grpc.ssl_channel_credentials(root_certificates=self.read(f"{trust}.crt"),
                                            private_key=self.read(f"{client}.key"),
                                            certificate_chain=self.read(f"{client}.crt"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("tls"))


def tls_env(certs: Certs, mutual: bool) -> dict:
    env = {"TLS_CERT_PATH": certs.path("server.crt"), "TLS_KEY_PATH": certs.path("server.key")}
    if mutual:
        env["TLS_CLIENT_CA_CERT_PATH"] = certs.path("ca.crt")
    return env


def stub_for(server: RouterServer, channel):
    return server.pb_grpc.GenerationServiceStub(channel)


def generate_ok(server: RouterServer, stub):
    pb = server.pb
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.max_sequence_length > 0
    r = stub.Generate(pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="Hello")],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=3))), timeout=30)
    assert r.responses[0].generated_token_count == 3


def refused(server: RouterServer, channel):
    with pytest.raises(grpc.RpcError) as e:
        stub_for(server, channel).ModelInfo(server.pb.ModelInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def secure_channel(server: RouterServer, credentials):
    return grpc.secure_channel(f"localhost:{server.port}", credentials,
                               options=[("grpc.ssl_target_name_override", "localhost")])


def test_tls(certs):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer("gpt2", env=tls_env(certs, mutual=False),
                          credentials=certs.credentials())
    try:
        assert "with TLS" in server.log()
        # A client that trusts the CA: the server's own channel.
        generate_ok(server, server.stub)
        # Plaintext against TLS.
        refused(server, grpc.insecure_channel(f"localhost:{server.port}"))
        # A client that trusts another CA does not accept the server.
        refused(server, secure_channel(server, certs.credentials(trust="other-ca")))
        # TLS without mTLS does not ask for client certificates; one sent anyway is fine.
        channel = secure_channel(server, certs.credentials(client="client"))
        generate_ok(server, stub_for(server, channel))
        channel.close()
    finally:
        server.close()


def test_mutual_tls(certs):
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = RouterServer("gpt2", env=tls_env(certs, mutual=True),
                          credentials=certs.credentials(client="client"))
    try:
        assert "with mTLS" in server.log()
        # A client certificate from the CA: the server's own channel.
        generate_ok(server, server.stub)
        # No client certificate.
        refused(server, secure_channel(server, certs.credentials()))
        # A client certificate from another CA.
        refused(server, secure_channel(server, certs.credentials(client="intruder")))
        # Plaintext.
        refused(server, grpc.insecure_channel(f"localhost:{server.port}"))
        # And the proper client still works on a new connection.
        channel = secure_channel(server, certs.credentials(client="client"))
        generate_ok(server, stub_for(server, channel))
        channel.close()
    finally:
        server.close()


def start_router(env: dict) -> subprocess.CompletedProcess:
    # TLS is checked before the router waits for any shard: no shard is needed to fail.
    return subprocess.run([str(binary(ROUTER_BINARY)), "--tokenizer-path", fixture_model_dir("gpt2"),
                           "--shard-uds-path", "/nonexistent/shard", "--port", "0",
                           "--shard-connect-timeout", "1"],
                          capture_output=True, text=True, timeout=30, env={**os.environ, **env})


def test_bad_tls_files_fail_at_start(certs, tmp_path):
    if not binary(ROUTER_BINARY).exists():
        pytest.skip("router not built")
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    missing = str(tmp_path / "missing.crt")
    cases = [
        # (environment, the file the message must name)
        ({**tls_env(certs, False), "TLS_CERT_PATH": missing}, missing),
        ({**tls_env(certs, False), "TLS_KEY_PATH": missing}, missing),
        ({**tls_env(certs, True), "TLS_CLIENT_CA_CERT_PATH": missing}, missing),
        ({**tls_env(certs, False), "TLS_CERT_PATH": str(junk)}, str(junk)),
        ({**tls_env(certs, False), "TLS_KEY_PATH": str(junk)}, str(junk)),
        ({**tls_env(certs, True), "TLS_CLIENT_CA_CERT_PATH": str(junk)}, str(junk)),
        # The key of another certificate.
        ({**tls_env(certs, False), "TLS_KEY_PATH": certs.path("client.key")},
         certs.path("client.key")),
    ]
    for env, named in cases:
        r = start_router(env)
        assert r.returncode != 0, (env, r.stderr)
        assert "invalid TLS configuration" in r.stderr, r.stderr
        assert named in r.stderr, (env, r.stderr)
        assert "waiting for" not in r.stderr  # failed before waiting for the shards
    r = start_router({**tls_env(certs, False), "TLS_KEY_PATH": certs.path("client.key")})
    assert "does not match the certificate" in r.stderr
    # Half a configuration is refused too.
    r = start_router({"TLS_CERT_PATH": certs.path("server.crt")})
    assert r.returncode != 0 and "TLS_KEY_PATH" in r.stderr


def launcher(tmp_path: Path, env: dict):
    from procs import Process
    from router_harness import free_port

    full = {"MODEL_NAME": str(fixture_model_dir("gpt2")), "GRPC_PORT": str(free_port()),
            "PORT": str(free_port()), "SHARD_UDS_PATH": str(tmp_path / "shard"),
            "TERMINATION_LOG": str(tmp_path / "termination-log"), "KV_CACHE_BLOCKS": "64",
            **env}
    return Process([binary("launcher/text-generation-launcher")], env=full), full


def test_launcher_passes_tls_and_port_to_the_router(certs, tmp_path):
    if not binary("launcher/text-generation-launcher").exists() or binaries_missing():
        pytest.skip("launcher, shard or router not built")
    from router_harness import http_get, wait_until

    proc, env = launcher(tmp_path, tls_env(certs, mutual=True))
    try:
        # /health on PORT turns 200 once the router serves (its first probe generates a token).
        assert wait_until(lambda: not proc.alive() or http_get(int(env["PORT"]), "/health")[0] == 200,
                          timeout=60), proc.output()
        assert proc.alive(), proc.output()
        from procs import proto_module

        pb, pb_grpc = proto_module("generation")
        channel = grpc.secure_channel(f"localhost:{env['GRPC_PORT']}",
                                      certs.credentials(client="client"),
                                      options=[("grpc.ssl_target_name_override", "localhost")])
        info = pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.max_sequence_length > 0
        channel.close()
        channel = grpc.secure_channel(f"localhost:{env['GRPC_PORT']}", certs.credentials(),
                                      options=[("grpc.ssl_target_name_override", "localhost")])
        with pytest.raises(grpc.RpcError):
            pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=5)
        channel.close()
    finally:
        proc.close()


def test_launcher_reports_a_bad_tls_key_in_the_termination_log(certs, tmp_path):
    if not binary("launcher/text-generation-launcher").exists() or binaries_missing():
        pytest.skip("launcher, shard or router not built")
    proc, env = launcher(tmp_path, {**tls_env(certs, mutual=False),
                                    "TLS_KEY_PATH": certs.path("client.key")})
    try:
        assert proc.proc.wait(timeout=60) != 0
        reason = Path(env["TERMINATION_LOG"]).read_text()
        assert certs.path("client.key") in reason, reason
    finally:
        proc.close()

"""deployment/: every kustomize overlay renders (kubectl kustomize) and every manifest validates
against the Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail), plus the
operational properties an OpenShift operator relies on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOYMENT = Path(__file__).resolve().parents[2] / "deployment"
OVERLAYS = sorted(p.name for p in (DEPLOYMENT / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.30.0"


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (make deps installs it)")
    out = subprocess.run([kubectl, "kustomize", str(path)], check=True, capture_output=True,
                         text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def deployment_of(docs):
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep


def server_container(dep):
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return c


def env_of(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("target", ["base"] + [f"overlays/{o}" for o in OVERLAYS])
def test_renders_and_validates(target):
    docs = render(DEPLOYMENT / target)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("target", ["base"] + [f"overlays/{o}" for o in OVERLAYS])
def test_operational_properties(target):
    docs = render(DEPLOYMENT / target)
    dep = deployment_of(docs)
    pod = dep["spec"]["template"]
    c = server_container(dep)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
        assert c[probe]["httpGet"]["port"] == "http", probe
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 8033, "http": 3000}
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "3000"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["models"] == "/models"
    # The shards' sockets need a writable /tmp under a read-only root.
    assert mounts["tmp"] == "/tmp" and env_of(c)["SHARD_UDS_PATH"].startswith("/tmp/")
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {8033, 3000}
    assert svc["spec"]["selector"] == pod["metadata"]["labels"] | svc["spec"]["selector"]


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_overlays_match_shards(gpus):
    c = server_container(deployment_of(render(DEPLOYMENT / "overlays" / f"gpu-{gpus}")))
    assert env_of(c)["NUM_SHARD"] == str(gpus)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)


def test_tls_and_mtls_overlays():
    tls = deployment_of(render(DEPLOYMENT / "overlays" / "tls"))
    env = env_of(server_container(tls))
    assert env["TLS_CERT_PATH"].endswith("tls.crt") and env["TLS_KEY_PATH"].endswith("tls.key")
    assert "TLS_CLIENT_CA_CERT_PATH" not in env
    secrets = [v for v in tls["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secrets and secrets[0]["secret"]["secretName"] == "text-generation-inference-tls"
    mtls = env_of(server_container(deployment_of(render(DEPLOYMENT / "overlays" / "mtls"))))
    assert mtls["TLS_CLIENT_CA_CERT_PATH"].endswith("ca.crt")


def test_pvc_overlay_mounts_the_claim():
    docs = render(DEPLOYMENT / "overlays" / "pvc-model-cache")
    assert any(d["kind"] == "PersistentVolumeClaim" for d in docs)
    vols = {v["name"]: v for v in deployment_of(docs)["spec"]["template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == "text-generation-inference-models"
    assert "emptyDir" not in vols["models"]

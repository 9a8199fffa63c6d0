"""`text-generation-server download-weights` (TGIS's command) against a local fake of the Hugging
Face Hub (fake_hub.py): which files it picks, the cache layout it writes (checked against what
`huggingface_hub` itself writes, and read back by `huggingface_hub`), revisions, resumed and
dropped downloads, checksum failures, tokens, offline mode, the cache directory variables, the
.bin -> .safetensors conversion, and the launcher downloading a model it does not have.

The first tests check the fake hub itself against the real `huggingface_hub` client, so that the
command's tests measure the command, not the fake."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_hub import FakeHub, git_blob_sha1, hub_url_quote, run_hf_client  # noqa: E402
from procs import FIXTURES, Process, binary, free_port, need_binaries, wait_serving  # noqa: E402

MODEL = FIXTURES / "models" / "llama"
BIN_CHECKPOINT = FIXTURES / "bin_checkpoints" / "llama"
SERVER = "server/text-generation-server"
LAUNCHER = "launcher/text-generation-launcher"

# What download-weights fetches from the llama fixture by default: .safetensors plus the four
# metadata extensions, top level only.
LLAMA_FILES = sorted(p.name for p in MODEL.iterdir()
                     if p.is_file() and p.suffix in (".safetensors", ".json", ".py", ".model", ".md"))

# Variables that would let the developer's own Hub settings leak into a test.
_HF_VARS = ("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME")


def need_hf():
    pytest.importorskip("huggingface_hub", reason="huggingface_hub (pip) is needed as the reference client")


@pytest.fixture(autouse=True)
def no_hf_settings(monkeypatch):
    """Drops the caller's HF_* variables from os.environ, which Process and our env() copy."""
    for name in list(os.environ):
        if name.startswith(_HF_VARS):
            monkeypatch.delenv(name)


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


@pytest.fixture
def llama(hub):
    """tiny/llama on the hub: the llama fixture, its .safetensors and tokenizer.model in LFS."""
    assert (MODEL / "model.safetensors").exists(), "model fixtures missing"
    hub.add_folder("tiny/llama", MODEL)
    return "tiny/llama"


def env(tmp_path: Path, hub: FakeHub, **overrides) -> dict:
    """An environment pointing at the fake hub with a private HOME, HF_HOME and cache; an
    override of None removes the variable."""
    e = dict(os.environ)
    e.update(HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf_home"),
             HF_HUB_CACHE=str(tmp_path / "cache"), HF_ENDPOINT=hub.endpoint,
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    for k, v in overrides.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = str(v)
    return e


def download(model_id: str, *args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    need_binaries()
    return subprocess.run([str(binary(SERVER)), "download-weights", model_id, *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def cache_tree(cache: Path, repo_id: str) -> dict[str, tuple[str, object]]:
    """Every leaf of a repo's cache folder: ("link", target) or ("file", bytes), by relative
    path. `.no_exist` (huggingface_hub's negative cache) is left out."""
    root = repo_dir(cache, repo_id)
    tree = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(".no_exist"):
            continue
        if p.is_symlink():
            tree[rel] = ("link", os.readlink(p))
        elif p.is_file():
            tree[rel] = ("file", p.read_bytes())
    return tree


def snapshot_files(cache: Path, repo_id: str, commit: str) -> dict[str, bytes]:
    snap = repo_dir(cache, repo_id) / "snapshots" / commit
    return {p.relative_to(snap).as_posix(): p.read_bytes()
            for p in sorted(snap.rglob("*")) if p.is_file()}


def refs(cache: Path, repo_id: str) -> dict[str, str]:
    root = repo_dir(cache, repo_id) / "refs"
    return {p.relative_to(root).as_posix(): p.read_text()
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def leftovers(cache: Path, repo_id: str) -> list[str]:
    return sorted(p.name for p in (repo_dir(cache, repo_id) / "blobs").glob("*.incomplete"))


def assert_downloaded(cache: Path, hub: FakeHub, repo_id: str, names, revision="main"):
    """The snapshot of `revision` holds exactly `names`, each a relative link to its blob, named
    by its etag and holding the hub's bytes."""
    commit = hub.commit(repo_id, revision)
    snap = repo_dir(cache, repo_id) / "snapshots" / commit
    assert snapshot_files(cache, repo_id, commit).keys() == set(names)
    for name in names:
        f = hub.file(repo_id, name, revision)
        link = snap / name
        assert link.is_symlink(), f"{name} is not a link"
        assert os.readlink(link) == "../" * (name.count("/") + 2) + "blobs/" + f.etag
        assert link.read_bytes() == f.data, name
    assert leftovers(cache, repo_id) == []


def partial_blob(cache: Path, hub: FakeHub, repo_id: str):
    """The first half of `repo_id`'s model.safetensors as a download left it: blobs/<sha>.incomplete.
    Returns (the file, half its size)."""
    f = hub.file(repo_id, "model.safetensors")
    half = len(f.data) // 2
    blobs = repo_dir(cache, repo_id) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{f.sha256}.incomplete").write_bytes(f.data[:half])
    return f, half


def cdn_gets(hub: FakeHub, sha256: str):
    return [r for r in hub.requests
            if r.server == "cdn" and r.method == "GET" and f"/cdn/{sha256}" in r.path]


# -- the fake hub against the real client ---------------------------------------------------


def test_fake_hub_model_info(tmp_path, hub, llama):
    need_hf()
    hub.add_repo("org/private", {"config.json": b"{}"}, private_token="hf_secret")
    e = env(tmp_path, hub)
    public, private, anonymous = run_hf_client([
        ("model_info", {"repo_id": llama, "files_metadata": True}),
        ("model_info", {"repo_id": "org/private", "token": "hf_secret"}),
        ("model_info", {"repo_id": "org/private", "token": False}),
    ], e)
    assert public["ok"]["id"] == llama and public["ok"]["sha"] == hub.commit(llama)
    assert sorted(public["ok"]["siblings"]) == sorted(hub.files(llama))
    assert public["ok"]["lfs"] == {n: f.sha256 for n, f in hub.files(llama).items() if f.lfs}
    assert private["ok"]["private"] is True
    assert anonymous["error"] == "RepositoryNotFoundError"


def test_fake_hub_hf_hub_download_and_cache_readers(tmp_path, hub):
    need_hf()
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(200_000)}
    commit = hub.add_repo("org/private", files, lfs={"model.safetensors"}, private_token="hf_secret")
    cache = tmp_path / "cache"
    e = env(tmp_path, hub)
    results = run_hf_client([
        ("hf_hub_download", {"repo_id": "org/private", "filename": name, "token": "hf_secret",
                             "cache_dir": str(cache)}) for name in files], e)
    for name, r in zip(files, results):
        assert r["ok"] == str(repo_dir(cache, "org/private") / "snapshots" / commit / name), r
    assert_downloaded(cache, hub, "org/private", files)
    assert refs(cache, "org/private") == {"main": commit}
    # The client's view of the protocol: token to the hub only, LFS through the CDN.
    hub_reqs = [r for r in hub.requests if r.server == "hub"]
    assert hub_reqs and all(r.authorization == "Bearer hf_secret" for r in hub_reqs)
    sha = hub.file("org/private", "model.safetensors").sha256
    [get] = cdn_gets(hub, sha)
    assert get.authorization is None and get.status == 200 and get.body_bytes == 200_000
    assert any(r.method == "HEAD" and r.status == 302 for r in hub_reqs)

    offline = env(tmp_path, hub, HF_HUB_OFFLINE=1)
    found, scan = run_hf_client([
        ("try_to_load_from_cache", {"repo_id": "org/private", "filename": "model.safetensors",
                                    "cache_dir": str(cache)}),
        ("scan_cache_dir", {"cache_dir": str(cache)})], offline)
    assert found["ok"].endswith(f"snapshots/{commit}/model.safetensors")
    assert scan["ok"]["warnings"] == []
    [repo] = scan["ok"]["repos"]
    assert repo["refs"] == {"main": commit}
    assert repo["revisions"] == {commit: sorted(files)}


def test_fake_hub_errors_as_the_client_expects(tmp_path, hub, llama):
    need_hf()
    hub.add_repo("org/private", {"config.json": b"{}"}, private_token="hf_secret")
    cache = str(tmp_path / "cache")
    results = run_hf_client([
        ("hf_hub_download", {"repo_id": "org/private", "filename": "config.json", "cache_dir": cache}),
        ("hf_hub_download", {"repo_id": "org/missing", "filename": "config.json", "cache_dir": cache}),
        ("hf_hub_download", {"repo_id": llama, "filename": "nope.json", "cache_dir": cache}),
        ("hf_hub_download", {"repo_id": llama, "filename": "config.json", "revision": "nope",
                             "cache_dir": cache}),
        ("hf_hub_download", {"repo_id": llama, "filename": "config.json", "token": "hf_wrong",
                             "cache_dir": cache}),
    ], env(tmp_path, hub))
    assert [r.get("error") for r in results] == [
        "RepositoryNotFoundError", "RepositoryNotFoundError", "EntryNotFoundError",
        "RevisionNotFoundError", "HfHubHTTPError"]
    assert "Invalid credentials" in results[-1]["message"]


def test_fake_hub_revisions(tmp_path, hub):
    need_hf()
    main = hub.add_repo("org/revs", {"config.json": b"1", "w.safetensors": b"A" * 1000},
                        lfs={"w.safetensors"})
    v2 = hub.add_repo("org/revs", {"config.json": b"2", "w.safetensors": b"B" * 1000},
                      lfs={"w.safetensors"}, branch="v2")
    feature = hub.add_repo("org/revs", {"config.json": b"3"}, branch="feature/x")
    cache = tmp_path / "cache"
    results = run_hf_client([
        ("snapshot_download", {"repo_id": "org/revs", "revision": rev, "cache_dir": str(cache)})
        for rev in ("v2", main, "feature/x")], env(tmp_path, hub))
    assert all("ok" in r for r in results), results
    assert refs(cache, "org/revs") == {"v2": v2, "feature/x": feature}
    assert snapshot_files(cache, "org/revs", main) == {"config.json": b"1", "w.safetensors": b"A" * 1000}
    assert snapshot_files(cache, "org/revs", v2)["config.json"] == b"2"
    assert any(f"/revision/{hub_url_quote('feature/x')}" in r.path for r in hub.requests)


def test_fake_hub_resume_and_dropped_connection(tmp_path, hub, llama):
    need_hf()
    cache = tmp_path / "cache"
    f, half = partial_blob(cache, hub, llama)
    results = run_hf_client([("hf_hub_download", {"repo_id": llama, "filename": "model.safetensors",
                                                  "cache_dir": str(cache)})], env(tmp_path, hub))
    assert all("ok" in r for r in results), results
    [get] = cdn_gets(hub, f.sha256)
    assert get.range == f"bytes={half}-" and get.status == 206 and get.body_bytes == len(f.data) - half

    # A body cut short: the response announced the full length, so the client notices. This
    # huggingface_hub gives up (IncompleteRead is no ConnectionError to it) having kept nothing
    # (it writes 10 MB chunks), so its next attempt asks for the whole file again.
    tok = hub.file(llama, "tokenizer.model")
    hub.truncate_after(5000, target="tokenizer.model")
    call = ("hf_hub_download", {"repo_id": llama, "filename": "tokenizer.model", "cache_dir": str(cache)})
    [failed] = run_hf_client([call], env(tmp_path, hub))
    assert "IncompleteRead" in failed.get("message", ""), failed
    [retried] = run_hf_client([call], env(tmp_path, hub))
    assert "ok" in retried, retried
    first, second = cdn_gets(hub, tok.sha256)
    assert first.body_bytes == 5000
    assert second.range is None and second.body_bytes == len(tok.data)
    assert_downloaded(cache, hub, llama, ["model.safetensors", "tokenizer.model"])


def test_fake_hub_corrupt_bytes_and_weak_etags(tmp_path):
    need_hf()
    with FakeHub(weak_etags=True) as hub:
        hub.add_repo("org/r", {"config.json": b"{}", "w.safetensors": b"x" * 4096},
                     lfs={"w.safetensors"})
        hub.corrupt("w.safetensors")
        cache = tmp_path / "cache"
        results = run_hf_client([
            ("hf_hub_download", {"repo_id": "org/r", "filename": n, "cache_dir": str(cache)})
            for n in ("config.json", "w.safetensors")], env(tmp_path, hub))
        assert all("ok" in r for r in results), results
        blobs = repo_dir(cache, "org/r") / "blobs"
        # A weak ETag names the same blob as a strong one.
        assert (blobs / git_blob_sha1(b"{}")).read_bytes() == b"{}"
        # huggingface_hub checks sizes only: the corrupted body lands, same length, wrong bytes.
        w = hub.file("org/r", "w.safetensors")
        got = (blobs / w.sha256).read_bytes()
        assert len(got) == len(w.data) and hashlib.sha256(got).hexdigest() != w.sha256


# -- download-weights -----------------------------------------------------------------------


def test_download_matches_huggingface_hub(tmp_path, hub, llama):
    """Same files, same tree, same bytes as huggingface_hub's own cache; and huggingface_hub
    reads ours."""
    need_hf()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    p = ok(download(llama, env=env(tmp_path, hub, HF_HUB_CACHE=ours)))
    assert p.stderr.strip(), "no progress on stderr"
    [ref] = run_hf_client([("snapshot_download", {"repo_id": llama, "cache_dir": str(theirs),
                                                  "allow_patterns": LLAMA_FILES})],
                          env(tmp_path, hub))
    assert "ok" in ref, ref
    assert cache_tree(ours, llama) == cache_tree(theirs, llama)
    assert_downloaded(ours, hub, llama, LLAMA_FILES)
    commit = hub.commit(llama)
    assert refs(ours, llama) == {"main": commit}

    found, found_lfs, scan = run_hf_client([
        ("try_to_load_from_cache", {"repo_id": llama, "filename": "config.json", "cache_dir": str(ours)}),
        ("try_to_load_from_cache", {"repo_id": llama, "filename": "model.safetensors",
                                    "cache_dir": str(ours)}),
        ("scan_cache_dir", {"cache_dir": str(ours)}),
    ], env(tmp_path, hub, HF_HUB_OFFLINE=1))
    assert found["ok"] == str(repo_dir(ours, llama) / "snapshots" / commit / "config.json")
    assert Path(found_lfs["ok"]).read_bytes() == (MODEL / "model.safetensors").read_bytes()
    assert scan["ok"]["warnings"] == []
    [repo] = scan["ok"]["repos"]
    assert repo["repo_id"] == llama and repo["refs"] == {"main": commit}
    assert repo["revisions"] == {commit: LLAMA_FILES}


MIXED = {
    "config.json": b'{"model_type": "llama"}', "README.md": b"# card", "modeling_custom.py": b"pass",
    "tokenizer.model": b"T" * 3000, "model.safetensors": b"S" * 5000,
    "sub/folder/extra.safetensors": b"E" * 100,      # not top level
    "training_args.bin": b"t" * 100,                 # "args", "training"
    "adapter_args.json": b"{}",                      # "args"
    "run_arguments.py": b"pass",                     # "arguments"
    "training_config.json": b"{}",                   # "training"
    "optimizer.pt": b"o" * 100, "pytorch_model.bin": b"P" * 100, "notes.txt": b"notes",
}
MIXED_LFS = {"tokenizer.model", "model.safetensors", "sub/folder/extra.safetensors",
             "training_args.bin", "optimizer.pt", "pytorch_model.bin"}
META = ["README.md", "config.json", "modeling_custom.py", "tokenizer.model"]


@pytest.mark.parametrize("args, expected", [
    ((), ["model.safetensors", *META]),
    # One extension outside the metadata four: the four are added.
    (("--extension", ".bin", "--no-auto-convert"), ["pytorch_model.bin", *META]),
    # Several: exactly those.
    (("--extension", ".bin,.pt", "--no-auto-convert"), ["optimizer.pt", "pytorch_model.bin"]),
    # One of the metadata four: only it.
    (("--extension", ".json", "--no-auto-convert"), ["config.json"]),
], ids=["default", "bin", "bin-and-pt", "json"])
def test_extension_filtering(tmp_path, hub, args, expected):
    hub.add_repo("org/mixed", MIXED, lfs=MIXED_LFS)
    cache = tmp_path / "cache"
    ok(download("org/mixed", *args, env=env(tmp_path, hub)))
    assert_downloaded(cache, hub, "org/mixed", expected)
    # Files left out are never even asked for.
    asked = {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests
             if "/resolve/" in r.path}
    assert asked == set(expected)


@pytest.mark.parametrize("revision", ["v2", "v1.0", "feature/x", "commit"])
def test_revision(tmp_path, hub, revision):
    main = hub.add_repo("org/revs", {"config.json": b"1", "w.safetensors": b"A" * 1000},
                        lfs={"w.safetensors"})
    hub.add_repo("org/revs", {"config.json": b"2", "w.safetensors": b"B" * 1000},
                 lfs={"w.safetensors"}, branch="v2")
    hub.add_repo("org/revs", {"config.json": b"3", "w.safetensors": b"C" * 1000},
                 lfs={"w.safetensors"}, branch="feature/x")
    hub.add_ref("org/revs", "v1.0", main)
    rev = main if revision == "commit" else revision
    commit = hub.commit("org/revs", rev)
    cache = tmp_path / "cache"
    ok(download("org/revs", "--revision", rev, env=env(tmp_path, hub)))
    assert_downloaded(cache, hub, "org/revs", ["config.json", "w.safetensors"], revision=rev)
    # A branch or tag is remembered in refs/<name> (a nested file for "feature/x"); a commit
    # needs no ref.
    assert refs(cache, "org/revs") == ({} if rev == commit else {rev: commit})
    assert [p.name for p in (repo_dir(cache, "org/revs") / "snapshots").iterdir()] == [commit]


def test_resume_from_incomplete_blob(tmp_path, hub, llama):
    cache = tmp_path / "cache"
    f, half = partial_blob(cache, hub, llama)
    ok(download(llama, env=env(tmp_path, hub)))
    [get] = cdn_gets(hub, f.sha256)
    assert get.range == f"bytes={half}-"
    assert get.body_bytes == len(f.data) - half
    assert_downloaded(cache, hub, llama, LLAMA_FILES)


def test_server_ignoring_range_restarts_the_file(tmp_path, hub, llama):
    """A CDN that answers a Range request with the whole file (200): the partial bytes are
    dropped and the blob is the file, not the half followed by the whole."""
    cache = tmp_path / "cache"
    f, half = partial_blob(cache, hub, llama)
    hub.ignore_range = True
    ok(download(llama, env=env(tmp_path, hub)))
    [get] = cdn_gets(hub, f.sha256)
    assert get.range == f"bytes={half}-" and get.status == 200
    assert get.body_bytes == len(f.data)
    assert_downloaded(cache, hub, llama, LLAMA_FILES)

def test_dropped_connection(tmp_path, hub, llama):
    """The connection drops once mid-body: the command retries by itself or fails and a second
    run completes; either way the cache ends right, and a resumed request starts no later than
    what had arrived."""
    cache = tmp_path / "cache"
    f = hub.file(llama, "model.safetensors")
    cut = len(f.data) // 3
    hub.truncate_after(cut, target="model.safetensors")
    e = env(tmp_path, hub)
    if download(llama, env=e).returncode != 0:
        ok(download(llama, env=e))
    assert_downloaded(cache, hub, llama, LLAMA_FILES)
    gets = cdn_gets(hub, f.sha256)
    assert gets[0].body_bytes == cut and len(gets) >= 2
    for g in gets[1:]:
        if g.range is not None:
            start = int(g.range.removeprefix("bytes=").rstrip("-"))
            assert 0 < start <= cut, g.range


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"], ids=["lfs-sha256", "git-sha1"])
def test_checksum_mismatch_fails(tmp_path, hub, llama, name):
    cache = tmp_path / "cache"
    f = hub.file(llama, name)
    hub.corrupt(name)
    e = env(tmp_path, hub)
    p = download(llama, env=e)
    assert p.returncode != 0
    assert name in p.stderr
    blobs = repo_dir(cache, llama) / "blobs"
    assert not (blobs / f.etag).exists()
    # A full-length .incomplete left behind would be "resumed" into the same failure forever.
    assert not (blobs / f"{f.etag}.incomplete").exists()
    assert not os.path.lexists(repo_dir(cache, llama) / "snapshots" / hub.commit(llama) / name)
    hub.reset_faults()
    ok(download(llama, env=e))
    assert_downloaded(cache, hub, llama, LLAMA_FILES)


@pytest.fixture
def private(hub):
    hub.add_folder("org/private", MODEL, private_token="hf_secret")
    return "org/private"


def test_private_repo_without_token_fails(tmp_path, hub, private):
    p = download(private, env=env(tmp_path, hub))
    assert p.returncode != 0
    assert "401" in p.stderr or "authoriz" in p.stderr.lower(), p.stderr
    assert not (repo_dir(tmp_path / "cache", private) / "snapshots").exists()


@pytest.mark.parametrize("source", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "--token", "token-file",
                                    "xdg-token-file"])
def test_private_repo_with_token(tmp_path, hub, private, source):
    args, extra = [], {}
    if source == "--token":
        args = ["--token", "hf_secret"]
    elif source == "token-file":
        (tmp_path / "hf_home").mkdir()
        (tmp_path / "hf_home" / "token").write_text("hf_secret\n")  # as `echo` writes it
    elif source == "xdg-token-file":  # huggingface_hub's home without HF_HOME
        extra.update(HF_HOME=None, XDG_CACHE_HOME=tmp_path / "xdg")
        (tmp_path / "xdg" / "huggingface").mkdir(parents=True)
        (tmp_path / "xdg" / "huggingface" / "token").write_text("hf_secret\n")
    else:
        extra[source] = "hf_secret"
    ok(download(private, *args, env=env(tmp_path, hub, **extra)))
    assert_downloaded(tmp_path / "cache", hub, private, LLAMA_FILES)
    hub_reqs = [r for r in hub.requests if r.server == "hub"]
    assert hub_reqs and all(r.authorization == "Bearer hf_secret" for r in hub_reqs)
    # The CDN is another origin: the token must not follow the redirect.
    cdn = [r for r in hub.requests if r.server == "cdn"]
    assert cdn and all(r.authorization is None for r in cdn)


def test_offline_without_cache_fails_without_asking(tmp_path, hub, llama):
    p = download(llama, env=env(tmp_path, hub, HF_HUB_OFFLINE=1))
    assert p.returncode != 0
    assert "HF_HUB_OFFLINE" in p.stderr
    assert hub.requests == []


def test_unknown_repo_fails(tmp_path, hub):
    p = download("org/not-there", env=env(tmp_path, hub))
    assert p.returncode != 0
    assert "org/not-there" in p.stderr


def test_second_run_downloads_nothing(tmp_path, hub, llama):
    e = env(tmp_path, hub)
    ok(download(llama, env=e))
    cache = tmp_path / "cache"
    before = {p: p.stat().st_mtime_ns for p in (repo_dir(cache, llama) / "blobs").iterdir()}
    hub.clear_log()
    ok(download(llama, env=e))
    assert hub.bytes_served == 0
    assert all(r.method == "HEAD" or r.path.startswith("/api/") for r in hub.requests), \
        [(r.method, r.path) for r in hub.requests]
    assert {p: p.stat().st_mtime_ns for p in (repo_dir(cache, llama) / "blobs").iterdir()} == before
    assert_downloaded(cache, hub, llama, LLAMA_FILES)


def test_weak_etags_are_normalised(tmp_path):
    with FakeHub(weak_etags=True) as hub:
        hub.add_repo("org/weak", {"config.json": b"{}", "model.safetensors": b"S" * 100},
                     lfs={"model.safetensors"})
        ok(download("org/weak", env=env(tmp_path, hub)))
        assert_downloaded(tmp_path / "cache", hub, "org/weak", ["config.json", "model.safetensors"])


@pytest.mark.parametrize("variables, where", [
    ({"HF_HUB_CACHE": "a"}, "a"),
    ({"HF_HUB_CACHE": None, "TRANSFORMERS_CACHE": "a"}, "a"),
    ({"HF_HUB_CACHE": None, "HUGGINGFACE_HUB_CACHE": "a"}, "a"),
    ({"HF_HUB_CACHE": "a", "TRANSFORMERS_CACHE": "a"}, "a"),
    ({"HF_HUB_CACHE": None, "HF_HOME": "h"}, "h/hub"),
    ({"HF_HUB_CACHE": None, "HF_HOME": None}, "home/.cache/huggingface/hub"),
    ({"HF_HUB_CACHE": None, "HF_HOME": None, "XDG_CACHE_HOME": "x"}, "x/huggingface/hub"),
    ({"HF_HUB_CACHE": None, "HF_HOME": "h", "XDG_CACHE_HOME": "x"}, "h/hub"),
], ids=["HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "same-twice", "HF_HOME", "HOME",
        "XDG_CACHE_HOME", "HF_HOME-over-XDG"])
def test_cache_dir_variables(tmp_path, hub, variables, where):
    hub.add_repo("org/small", {"config.json": b"{}", "model.safetensors": b"S" * 100},
                 lfs={"model.safetensors"})
    e = env(tmp_path, hub, **{k: None if v is None else tmp_path / v for k, v in variables.items()})
    ok(download("org/small", env=e))
    assert_downloaded(tmp_path / where, hub, "org/small", ["config.json", "model.safetensors"])
    if "TRANSFORMERS_CACHE" not in variables:  # a transformers variable, not huggingface_hub's
        # The reference: where huggingface_hub itself puts the cache in the same environment.
        need_hf()
        ref = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; "
                              "print(c.HF_HUB_CACHE)"], env=e, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert Path(ref) == tmp_path / where


def test_conflicting_cache_dir_variables_fail(tmp_path, hub):
    hub.add_repo("org/small", {"config.json": b"{}"})
    p = download("org/small", env=env(tmp_path, hub, HF_HUB_CACHE=tmp_path / "a",
                                      TRANSFORMERS_CACHE=tmp_path / "b"))
    assert p.returncode != 0
    assert "TRANSFORMERS_CACHE" in p.stderr
    assert hub.requests == []


def safetensors_tensors(path: Path) -> dict[str, tuple[str, list, bytes]]:
    """name -> (dtype, shape, raw bytes), read with the format's own layout (8-byte header
    length, JSON header, data) so the test needs neither torch nor safetensors."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {name: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in header.items() if name != "__metadata__"}


def test_auto_convert_bin_to_safetensors(tmp_path, hub):
    if not (BIN_CHECKPOINT / "pytorch_model.bin").exists():
        pytest.skip(f"{BIN_CHECKPOINT}/pytorch_model.bin fixture missing")
    # The llama fixture's config and tokenizer, with its weights as torch saved them.
    files = {p.name: p.read_bytes() for p in MODEL.iterdir()
             if p.is_file() and p.suffix != ".safetensors"}
    files.update({p.relative_to(BIN_CHECKPOINT).as_posix(): p.read_bytes()
                  for p in BIN_CHECKPOINT.rglob("*") if p.is_file()})
    assert not any(n.endswith(".safetensors") for n in files)
    hub.add_repo("org/bin", files, lfs={n for n in files if n.endswith((".bin", ".model"))})
    cache = tmp_path / "cache"
    ok(download("org/bin", env=env(tmp_path, hub)))
    snap = repo_dir(cache, "org/bin") / "snapshots" / hub.commit("org/bin")
    assert (snap / "pytorch_model.bin").read_bytes() == files["pytorch_model.bin"]
    converted = snap / "model.safetensors"
    assert converted.exists(), sorted(p.name for p in snap.iterdir())
    got, want = safetensors_tensors(converted), safetensors_tensors(MODEL / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, (dtype, shape, data) in want.items():
        assert got[name][:2] == (dtype, shape), name
        assert got[name][2] == data, f"{name}: values differ"


def test_launcher_downloads_missing_model_and_serves(tmp_path, hub, llama):
    need_binaries()
    pytest.importorskip("grpc")
    cache = tmp_path / "cache"
    grpc_port = free_port()
    e = env(tmp_path, hub)
    proc = Process([binary(LAUNCHER)], env={
        **{k: e[k] for k in ("HOME", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT")},
        "MODEL_NAME": llama, "GRPC_PORT": str(grpc_port), "PORT": str(free_port()),
        "SHARD_UDS_PATH": str(tmp_path / "shard"), "TERMINATION_LOG": str(tmp_path / "termination-log"),
        "KV_CACHE_BLOCKS": "64", "SHUTDOWN_GRACE_PERIOD": "10"})
    try:
        _, pb, stub = wait_serving(proc, grpc_port, timeout=180)
        prompt = next(p for p in json.loads((MODEL / "golden.json").read_text())["prompts"]
                      if p["text"] == "Hello world!")
        r = stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=prompt["text"])],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=5))), timeout=60)
        # The tokenizer came down with the weights: the prompt counts as the golden ids do.
        assert r.responses[0].input_token_count == len(prompt["input_ids"])
        assert r.responses[0].generated_token_count == 5
        # Progress: the download's and the weights load's closing lines reach the log.
        out = proc.output()
        assert f"download {llama}: done, " in out and "loading weights (1 files) from " in out
    finally:
        proc.close()
    assert_downloaded(cache, hub, llama, LLAMA_FILES)
    assert cdn_gets(hub, hub.file(llama, "model.safetensors").sha256)

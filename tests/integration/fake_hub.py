"""A local stand-in for the Hugging Face Hub, for testing downloads without a network.

It speaks the Hub's HTTP protocol as the `huggingface_hub` client relies on it:

* `GET /api/models/{repo_id}[/revision/{revision}]`: the repository's metadata (commit sha and
  file listing, `?blobs=true` adds sizes, blob ids and LFS info).
* `HEAD|GET /{repo_id}/resolve/{revision}/{filename}`: a regular (git) file is answered in place
  with `ETag: "<git blob sha1>"`; an LFS file is a 302 to a signed URL on a *second* server (the
  "CDN", another port, so another origin as cdn-lfs.hf.co is for huggingface.co) carrying
  `X-Linked-Etag: "<sha256>"` and `X-Linked-Size`. Both carry `X-Repo-Commit`.
* `HEAD|GET /cdn/{sha256}?...signature...` on the CDN: the bytes, honouring `Range`. Like S3 it
  refuses a request that carries an `Authorization` header besides the signed query string, so a
  client that forwards the Hub token across origins fails loudly.

Errors are the Hub's: 404/401 with `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound)
and `X-Error-Message`. A private or unknown repository answers 401 to an anonymous request and
404 to an authenticated one (the Hub does not reveal which repositories exist); an unknown token
is a 401 "Invalid credentials in Authorization header" even for public repositories.

Everything a test may want to check or break is on `FakeHub`: the request log, the bytes served,
corrupted bodies and connections dropped mid-body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_SHORT_SHA = re.compile(r"^[0-9a-f]{7,39}$")
_CHUNK = 64 * 1024


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file: what the Hub sends as the ETag of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS file."""
    return (f"version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n").encode()


@dataclass(frozen=True)
class HubFile:
    name: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        """The id of the git blob: of the pointer file for an LFS file."""
        return git_blob_sha1(lfs_pointer(self.data) if self.lfs else self.data)

    @property
    def etag(self) -> str:
        """The name of this file's blob in a huggingface_hub cache (blobs/<etag>)."""
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class _Commit:
    sha: str
    files: dict[str, HubFile]


@dataclass
class _Repo:
    repo_id: str
    default_branch: str
    private_token: str | None = None
    commits: dict[str, _Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha


@dataclass
class Request:
    """One request as the fake hub saw it. `headers` has lower-case names."""
    server: str           # "hub" or "cdn"
    method: str
    path: str             # as sent, query string included
    headers: dict[str, str]
    status: int = 0
    body_bytes: int = 0   # bytes of file content written (not redirect or error bodies)

    @property
    def range(self) -> str | None:
        return self.headers.get("range")

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


class _Error(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class FakeHub:
    """Serves registered repositories on http://127.0.0.1:<port> until closed.

        with FakeHub() as hub:
            sha = hub.add_folder("org/llama", FIXTURES / "models" / "llama")
            env = {"HF_ENDPOINT": hub.endpoint}
    """

    def __init__(self, weak_etags: bool = False):
        # weak_etags: send regular files' ETag as W/"<sha1>", which some Hub front ends do and
        # clients must normalise before naming blobs.
        self.weak_etags = weak_etags
        self.ignore_range = False  # a CDN that answers every GET whole (200), as some proxies do
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        # sha256 -> one of the files with that content: the LFS store, shared by all repos
        # like the real one; and every name it goes by, for the knobs that take a filename.
        self._lfs_store: dict[str, HubFile] = {}
        self._lfs_names: dict[str, set[str]] = {}
        self._log: list[Request] = []
        self._bytes_served = 0
        self._corrupt: set[str] = set()
        self._truncations: list[list] = []  # [n_bytes, target or None, remaining times]
        self._secret = os.urandom(16)
        self._hub = self._serve("hub")
        self._cdn = self._serve("cdn")
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn_endpoint = f"http://127.0.0.1:{self._cdn.server_address[1]}"

    # -- lifecycle --------------------------------------------------------------------------

    def _serve(self, role: str) -> ThreadingHTTPServer:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub, Handler.role = hub, role
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        # A short poll interval: shutdown() waits for it, once per test.
        threading.Thread(target=server.serve_forever, args=(0.05,), name=f"fake-hub-{role}",
                         daemon=True).start()
        return server

    def close(self):
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc):
        self.close()

    # -- repositories -----------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes], lfs: set[str] | None = None,
                 branch: str = "main", private_token: str | None = None) -> str:
        """Adds a commit holding exactly `files` and points `branch` at it; returns its sha.
        Called again for the same repo (with another branch, or the same one) it adds a new
        commit, so older commits stay reachable by sha. `lfs` names the files stored in LFS."""
        lfs = set(lfs or ())
        unknown = lfs - set(files)
        if unknown:
            raise ValueError(f"lfs names files not in the repo: {sorted(unknown)}")
        hub_files = {name: HubFile(name, bytes(data), name in lfs) for name, data in files.items()}
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                repo = self._repos[repo_id] = _Repo(repo_id, default_branch=branch)
            if private_token is not None:
                repo.private_token = private_token
            # A commit id that depends on its parent as well as its tree, like git's, so the
            # same files committed on two branches still give two commits.
            listing = "".join(f"{f.name}\0{f.git_oid}\n" for f in sorted(hub_files.values(),
                                                                       key=lambda f: f.name))
            parent = repo.refs.get(branch, "")
            sha = hashlib.sha1(f"{repo_id}\0{branch}\0{parent}\0{listing}".encode()).hexdigest()
            repo.commits[sha] = _Commit(sha, hub_files)
            repo.refs[branch] = sha
            for f in hub_files.values():
                if f.lfs:
                    self._lfs_store.setdefault(f.sha256, f)
                    self._lfs_names.setdefault(f.sha256, set()).add(f.name)
        return sha

    def add_folder(self, repo_id: str, path, lfs_suffixes=(".safetensors", ".bin", ".model"),
                   **kwargs) -> str:
        """add_repo with every file under `path` (names relative, with '/'), the ones ending with
        one of `lfs_suffixes` in LFS."""
        root = Path(path)
        files = {p.relative_to(root).as_posix(): p.read_bytes()
                 for p in sorted(root.rglob("*")) if p.is_file()}
        lfs = {name for name in files if name.endswith(tuple(lfs_suffixes))}
        return self.add_repo(repo_id, files, lfs=lfs, **kwargs)

    def add_ref(self, repo_id: str, name: str, commit: str):
        """Points a branch or tag `name` at an existing commit."""
        with self._lock:
            repo = self._repos[repo_id]
            if commit not in repo.commits:
                raise KeyError(commit)
            repo.refs[name] = commit

    def commit(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            return self._resolve_revision(self._repos[repo_id], revision).sha

    def file(self, repo_id: str, filename: str, revision: str = "main") -> HubFile:
        with self._lock:
            return self._resolve_revision(self._repos[repo_id], revision).files[filename]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, HubFile]:
        with self._lock:
            return dict(self._resolve_revision(self._repos[repo_id], revision).files)

    # -- instrumentation ----------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    @property
    def bytes_served(self) -> int:
        """File content bytes written so far (by both servers)."""
        with self._lock:
            return self._bytes_served

    def clear_log(self):
        with self._lock:
            self._log.clear()
            self._bytes_served = 0

    def corrupt(self, key: str):
        """Serves wrong bytes of the right length for a file, named by its filename, sha256 or
        git oid (the checksum still is the right one, so a verifying client must notice)."""
        with self._lock:
            self._corrupt.add(key)

    def truncate_after(self, n_bytes: int, target: str | None = None, times: int = 1):
        """Drops the connection after `n_bytes` of the next `times` file bodies (of `target`, a
        filename, sha256 or git oid, when given): the response announced the full length, so the
        client sees a short read."""
        with self._lock:
            self._truncations.append([n_bytes, target, times])

    def reset_faults(self):
        with self._lock:
            self._corrupt.clear()
            self._truncations.clear()

    # -- request handling (called from the handler threads) ---------------------------------

    def _record(self, request: Request):
        with self._lock:
            self._log.append(request)

    def _count(self, request: Request, n: int):
        with self._lock:
            request.body_bytes += n
            self._bytes_served += n

    def _keys(self, f: HubFile) -> set[str]:
        """What corrupt() and truncate_after() may name `f` by (under the lock)."""
        return {f.name, f.sha256, f.git_oid} | (self._lfs_names.get(f.sha256, set()) if f.lfs else set())

    def _take_truncation(self, f: HubFile) -> int | None:
        with self._lock:
            for t in self._truncations:
                n, target, times = t
                if times > 0 and (target is None or target in self._keys(f)):
                    t[2] -= 1
                    return n
        return None

    def _body(self, f: HubFile) -> bytes:
        with self._lock:
            corrupt = bool(self._keys(f) & self._corrupt)
        if not corrupt or not f.data:
            return f.data
        # Every byte changed, length kept: a size check alone cannot catch it.
        return bytes(b ^ 0x5A for b in f.data)

    def _resolve_revision(self, repo: _Repo, revision: str) -> _Commit:
        if revision in repo.refs:
            return repo.commits[repo.refs[revision]]
        if _HEX40.match(revision) and revision in repo.commits:
            return repo.commits[revision]
        if _SHORT_SHA.match(revision):
            matches = [c for sha, c in repo.commits.items() if sha.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        raise _Error(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _known_token(self, token: str) -> bool:
        return any(r.private_token == token for r in self._repos.values())

    def _repo_for(self, repo_id: str, token: str | None) -> _Repo:
        with self._lock:
            if token is not None and not self._known_token(token):
                raise _Error(401, None, "Invalid credentials in Authorization header")
            repo = self._repos.get(repo_id)
            if repo is None or (repo.private_token is not None and token != repo.private_token):
                if token is None:
                    raise _Error(401, "RepoNotFound", "Invalid username or password.")
                raise _Error(404, "RepoNotFound", "Repository not found")
            return repo

    def _split_repo(self, segments: list[str]) -> tuple[str, list[str]]:
        """Splits path segments into a repo id ("org/name", or a legacy "name") and the rest."""
        with self._lock:
            if len(segments) >= 2 and f"{segments[0]}/{segments[1]}" in self._repos:
                return f"{segments[0]}/{segments[1]}", segments[2:]
            if segments and segments[0] in self._repos:
                return segments[0], segments[1:]
        return "/".join(segments[:2]), segments[2:]

    def _signed_path(self, sha256: str) -> str:
        sig = hmac.new(self._secret, sha256.encode(), "sha256").hexdigest()[:32]
        # Query parameters like a presigned CDN URL's: clients must use the Location verbatim.
        return f"/cdn/{sha256}?response-content-disposition=attachment&Expires=4102444800&Signature={sig}"

    def _signature_ok(self, sha256: str, query: str) -> bool:
        sig = hmac.new(self._secret, sha256.encode(), "sha256").hexdigest()[:32]
        return parse_qs(query).get("Signature") == [sig]

    def _lfs_file(self, sha256: str) -> HubFile | None:
        with self._lock:
            return self._lfs_store.get(sha256)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clients of the real Hub get
    hub: FakeHub
    role: str

    def log_message(self, *args):  # the request log replaces stderr chatter
        pass

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool):
        record = Request(self.role, self.command, self.path,
                         {k.lower(): v for k, v in self.headers.items()})
        self.hub._record(record)
        self._record = record
        url = urlsplit(self.path)
        try:
            if self.role == "cdn":
                self._cdn(url, head)
            elif url.path.startswith("/api/models/"):
                self._api(url)
            else:
                self._resolve(url, head)
        except _Error as e:
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            self._send(e.status, json.dumps({"error": e.message}).encode(), headers,
                       content_type="application/json", head=head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization")
        if auth is None:
            return None
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else auth

    def _api(self, url):
        segments = [unquote(s) for s in url.path[len("/api/models/"):].split("/") if s]
        repo_id, rest = self.hub._split_repo(segments)
        repo = self.hub._repo_for(repo_id, self._token())
        if not rest:
            revision = repo.default_branch
        elif len(rest) == 2 and rest[0] == "revision":
            revision = rest[1]
        else:
            raise _Error(404, None, "Sorry, we can't find the page you are looking for.")
        with self.hub._lock:
            commit = self.hub._resolve_revision(repo, revision)
        blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for f in sorted(commit.files.values(), key=lambda f: f.name):
            entry = {"rfilename": f.name}
            if blobs:
                entry.update(size=len(f.data), blobId=f.git_oid)
                if f.lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": len(f.data),
                                    "pointerSize": len(lfs_pointer(f.data))}
            siblings.append(entry)
        info = {"_id": hashlib.md5(repo_id.encode()).hexdigest()[:24], "id": repo_id,
                "modelId": repo_id, "author": repo_id.split("/")[0] if "/" in repo_id else None,
                "sha": commit.sha, "lastModified": "2024-01-01T00:00:00.000Z",
                "createdAt": "2024-01-01T00:00:00.000Z", "private": repo.private_token is not None,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "library_name": "transformers", "siblings": siblings}
        self._send(200, json.dumps(info).encode(), {}, content_type="application/json", head=False)

    def _resolve(self, url, head: bool):
        # The revision is one segment (quoted with safe="" by clients, so "refs/pr/1" arrives as
        # "refs%2Fpr%2F1"); unquoting before splitting would misread a revision with a slash.
        raw = [s for s in url.path.split("/") if s]
        if "resolve" not in raw[1:3]:
            raise _Error(404, None, "Sorry, we can't find the page you are looking for.")
        i = raw.index("resolve", 1)
        repo_id = unquote("/".join(raw[:i]))
        if len(raw) < i + 3:
            raise _Error(404, None, "Sorry, we can't find the page you are looking for.")
        revision = unquote(raw[i + 1])
        filename = unquote("/".join(raw[i + 2:]))
        repo = self.hub._repo_for(repo_id, self._token())
        with self.hub._lock:
            commit = self.hub._resolve_revision(repo, revision)
        f = commit.files.get(filename)
        if f is None:
            raise _Error(404, "EntryNotFound", f"{filename} does not exist on \"{revision}\"",
                         commit=commit.sha)
        if f.lfs:
            location = self.hub.cdn_endpoint + self.hub._signed_path(f.sha256)
            text = f"Found. Redirecting to {location}".encode()
            self._send(302, text, {
                "Location": location,
                "X-Repo-Commit": commit.sha,
                # The resolve endpoint's own ETag is the git object's (the pointer file's):
                # a client must prefer X-Linked-Etag to name the blob.
                "ETag": f'"{f.git_oid}"',
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(len(f.data)),
                "Accept-Ranges": "bytes",
            }, content_type="text/plain; charset=utf-8", head=head)
            return
        etag = f'W/"{f.git_oid}"' if self.hub.weak_etags else f'"{f.git_oid}"'
        self._send_file(f, {"ETag": etag, "X-Repo-Commit": commit.sha}, head)

    def _cdn(self, url, head: bool):
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", url.path)
        f = self.hub._lfs_file(m.group(1)) if m else None
        if f is None:
            raise _Error(404, None, "NoSuchKey")
        if not self.hub._signature_ok(f.sha256, url.query):
            raise _Error(403, None, "AccessDenied: bad or missing signature")
        if "Authorization" in self.headers:
            # S3's answer to a presigned URL fetched with a header token as well.
            raise _Error(400, None, "Only one auth mechanism allowed; only the X-Amz-Algorithm "
                                    "query parameter, Signature query string parameter or the "
                                    "Authorization header should be specified")
        self._send_file(f, {"ETag": f'"{f.sha256}"'}, head, content_type="binary/octet-stream")

    def _send_file(self, f: HubFile, headers: dict, head: bool,
                   content_type: str = "text/plain; charset=utf-8"):
        body = self.hub._body(f)
        total = len(body)
        start, end, status = 0, total, 200
        spec = None if self.hub.ignore_range else self.headers.get("Range")
        if spec is not None:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", spec.strip())
            if not m or int(m.group(1)) >= total:
                self._send(416, b"", {"Content-Range": f"bytes */{total}", **headers}, head=head)
                return
            start = int(m.group(1))
            end = min(total, int(m.group(2)) + 1) if m.group(2) else total
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{total}"}
        self.send_response(status)
        for name, value in {**headers, "Content-Type": content_type, "Accept-Ranges": "bytes",
                            "Content-Length": str(end - start)}.items():
            self.send_header(name, value)
        self.end_headers()
        self._record.status = status
        if head:
            return
        limit = None if self.command != "GET" else self.hub._take_truncation(f)
        stop = end if limit is None else min(end, start + limit)
        pos = start
        while pos < stop:
            chunk = body[pos:min(stop, pos + _CHUNK)]
            self.wfile.write(chunk)
            self.hub._count(self._record, len(chunk))
            pos += len(chunk)
        if stop < end:
            # Announced more than we sent: close so the client sees the body end early.
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _send(self, status: int, body: bytes, headers: dict, content_type: str = "text/plain",
              head: bool = False):
        self.send_response(status)
        for name, value in {**headers, "Content-Type": content_type,
                            "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self._record.status = status
        if not head and body:
            self.wfile.write(body)


# -- the real client, for comparison ---------------------------------------------------------

_CLIENT = r"""
import json, os, sys
import huggingface_hub as hh

def scan(cache_dir):
    info = hh.scan_cache_dir(cache_dir)
    return {"warnings": [str(w) for w in info.warnings],
            "repos": [{"repo_id": r.repo_id, "repo_type": r.repo_type, "size_on_disk": r.size_on_disk,
                       "refs": {ref: rev.commit_hash for ref, rev in r.refs.items()},
                       "revisions": {rev.commit_hash: sorted(f.file_name for f in rev.files)
                                     for rev in r.revisions}}
                      for r in info.repos]}

results = []
for op, kwargs in json.loads(sys.argv[1]):
    try:
        if op == "scan_cache_dir":
            value = scan(**kwargs)
        elif op == "model_info":
            info = hh.HfApi().model_info(**kwargs)
            value = {"id": info.id, "sha": info.sha, "private": info.private,
                     "siblings": [s.rfilename for s in info.siblings],
                     "lfs": {s.rfilename: s.lfs.sha256 for s in info.siblings if s.lfs}}
        else:
            value = getattr(hh, op)(**kwargs)
            if not isinstance(value, (str, type(None))):
                value = repr(value)
        results.append({"ok": value})
    except Exception as e:
        results.append({"error": type(e).__name__, "message": str(e)})
print(json.dumps(results))
"""


def run_hf_client(ops: list[tuple[str, dict]], env: dict, timeout: float = 120) -> list[dict]:
    """Runs huggingface_hub calls in a fresh interpreter (it reads HF_ENDPOINT, HF_HUB_CACHE,
    HF_HUB_OFFLINE... when imported, so the environment must be right before the import).
    `ops` are (function name, kwargs): any top-level huggingface_hub function, plus "model_info"
    and "scan_cache_dir" whose results are summarised as JSON. Returns one {"ok": value} or
    {"error": exception class name, "message": ...} per op."""
    p = subprocess.run([sys.executable, "-c", _CLIENT, json.dumps(ops)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"huggingface_hub client failed ({p.returncode}):\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def hub_url_quote(revision: str) -> str:
    """How clients put a revision in a URL: one path segment, "/" escaped too."""
    return quote(revision, safe="")

"""A local Hugging Face Hub for tests: the HTTP endpoints huggingface_hub calls, on 127.0.0.1.

Two servers share one state:

- the Hub (``endpoint``): ``GET /api/models/{org}/{name}[/revision/{rev}]`` (model info, with
  file sizes and SHA-256 when ``blobs`` is asked), and ``HEAD``/``GET
  /{org}/{name}/resolve/{rev}/{file}``. Small files are served directly (ETag: git blob sha1;
  ``Range`` answered with 206); weights (``*.safetensors``, ``*.bin``) are answered with a 302 to
  the CDN, carrying ``X-Linked-Etag`` (SHA-256) and ``X-Linked-Size``, as the real Hub does for LFS
  files. Every answer carries ``X-Repo-Commit``. Errors carry the ``X-Error-Code`` huggingface_hub
  maps to its exceptions: ``RepoNotFound``, ``GatedRepo`` (401 without a token, 403 with a token
  that has no access), ``RevisionNotFound``, ``EntryNotFound``. No Xet header is ever sent, so
  downloads take the plain HTTP path.
- dataset repos (``add_commit(..., repo_type="dataset")``), as the ``datasets`` library reads
  them: ``GET /api/datasets/{org}/{name}[/revision/{rev}]`` (dataset info),
  ``GET /api/{models,datasets}/{org}/{name}/tree/{rev}[/{folder}]`` (the file tree, ``recursive``
  or one level), ``POST /api/{models,datasets}/{org}/{name}/paths-info/{rev}`` (the entries of the
  paths asked for), and ``HEAD``/``GET /datasets/{org}/{name}/resolve/{rev}/{path}``; files may lie
  in folders (``data/train.jsonl``). Parquet and Arrow files go through the CDN, as LFS files.
- the CDN (another port, addressed as ``localhost``: another host, as the real Hub's CDN is, so
  huggingface_hub does not follow the redirect when it reads metadata and drops the Authorization
  header when it downloads): ``GET /cdn/{sha256}`` with ``Range`` support (206 + ``Content-Range``).

Switches: ``drop[filename] = n`` cuts the connection halfway through that file's next ``n`` CDN
answers (after sending headers that promise the whole file); ``corrupt[filename] = n`` flips one
byte of its next ``n`` CDN answers (same length); ``hidden`` holds file names that the listing
shows but ``resolve`` answers with EntryNotFound (a file deleted meanwhile); ``down()`` stops both
servers (no network). ``requests`` records every request (server, method, path, headers).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")
#: Data files a dataset repo keeps in LFS (served through the CDN); not weights.
DATA_LFS_SUFFIXES = (".parquet", ".arrow")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated: bool = False
    granted_tokens: set[str] = field(default_factory=set)


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    headers: dict[str, str]


class LocalHub:
    """Repos in memory, served over HTTP on 127.0.0.1 (see the module docstring)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, tuple[str, bytes]] = {}  # sha256 -> (file name, content)
        self.drop: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.hidden: set[str] = set()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self.endpoint = self.cdn = ""

    # -- content ------------------------------------------------------------------------------

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        refs: tuple[str, ...] = ("main",),
        gated: bool = False,
        granted_tokens: tuple[str, ...] = (),
        repo_type: str = "model",
    ) -> str:
        """Add a commit holding ``files`` (paths in the repo: ``data/train.jsonl``) to ``repo_id`` of
        ``repo_type`` (model or dataset; created if new) and point ``refs`` at it."""
        repo = self.repos.setdefault(repo_key(repo_id, repo_type), Repo())
        repo.gated = repo.gated or gated
        repo.granted_tokens.update(granted_tokens)
        digest = hashlib.sha1(json.dumps([repo_id, len(repo.commits), sorted(files)]).encode())
        for name in sorted(files):
            digest.update(files[name])
        sha = digest.hexdigest()
        repo.commits[sha] = dict(files)
        for ref in refs:
            repo.refs[ref] = sha
        for name, data in files.items():
            if is_lfs(name):
                self.blobs[hashlib.sha256(data).hexdigest()] = (name, data)
        return sha

    @staticmethod
    def folder_files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}

    # -- serving ------------------------------------------------------------------------------

    def start(self) -> LocalHub:
        for role in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, role))
            server.daemon_threads = True
            threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"local-{role}", daemon=True
            ).start()
            self._servers.append(server)
        self.endpoint = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn = f"http://localhost:{self._servers[1].server_address[1]}"
        return self

    def down(self) -> None:
        """Stop serving: the ports refuse connections from now on (no network)."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    def log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def weight_requests(self) -> list[Request]:
        """Requests for weight files, on either server (a dataset's data files are not weights)."""

        def weights(request: Request) -> bool:
            path = request.path.split("?")[0]
            if request.server == "cdn":
                name = self.blobs.get(path.rsplit("/", 1)[-1], ("",))[0]
                return not name.endswith(DATA_LFS_SUFFIXES)
            return path.endswith(LFS_SUFFIXES)

        return [r for r in self.requests if weights(r)]

    def data_requests(self, repo_id: str) -> list[Request]:
        """Requests to the Hub about dataset ``repo_id``: its API and its files."""
        return [
            r
            for r in self.requests
            if r.server == "hub"
            and (f"/datasets/{repo_id}/" in r.path or r.path.split("?")[0].endswith(f"/datasets/{repo_id}"))
        ]


def repo_key(repo_id: str, repo_type: str = "model") -> str:
    """Where a repo is kept in :attr:`LocalHub.repos`: models by their id, datasets as ``datasets/{id}``."""
    if repo_type not in ("model", "dataset"):
        raise ValueError(f"repo_type {repo_type!r}: model or dataset")
    return repo_id if repo_type == "model" else f"datasets/{repo_id}"


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES + DATA_LFS_SUFFIXES)


def _handler(hub: LocalHub, role: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: a cut connection affects one download

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode()) if length else {}
            hub.log(Request(role, self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            segments = [unquote(s) for s in urlsplit(self.path).path.split("/")[1:]]
            # /api/{models,datasets}/{org}/{name}/paths-info/{rev}
            if role == "hub" and len(segments) == 6 and segments[0] == "api" and segments[4] == "paths-info":
                return self._paths_info(
                    _key(segments[1], f"{segments[2]}/{segments[3]}"), segments[5], form.get("paths", [])
                )
            self._error(404, None, "Not found")

        # -- dispatch -------------------------------------------------------------------------

        def _serve(self, body: bool) -> None:
            hub.log(Request(role, self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            parts = urlsplit(self.path)
            segments = [unquote(s) for s in parts.path.split("/")[1:]]
            if role == "cdn":
                return self._cdn(segments, body)
            if segments[:1] == ["api"] and len(segments) >= 4 and segments[1] in ("models", "datasets"):
                key = _key(segments[1], f"{segments[2]}/{segments[3]}")
                if len(segments) >= 6 and segments[4] == "tree":
                    recursive = parse_qs(parts.query).get("recursive", ["False"])[0].lower() == "true"
                    return self._tree(key, segments[5], "/".join(segments[6:]), recursive)
                rev = segments[5] if len(segments) >= 6 and segments[4] == "revision" else "main"
                return self._model_info(key, rev, "blobs" in parse_qs(parts.query))
            if len(segments) >= 6 and segments[0] == "datasets" and segments[3] == "resolve":
                return self._resolve(
                    repo_key(f"{segments[1]}/{segments[2]}", "dataset"), segments[4], "/".join(segments[5:]), body
                )
            if len(segments) >= 5 and segments[2] == "resolve":
                return self._resolve(f"{segments[0]}/{segments[1]}", segments[3], "/".join(segments[4:]), body)
            self._error(404, None, "Not found")

        def _lookup(self, repo_id: str, rev: str, *, files: bool):
            repo = hub.repos.get(repo_id)
            if repo is None:
                # The real Hub answers 401 for an unknown repo when no token is sent, 404 otherwise.
                status = 404 if self._token() else 401
                self._error(status, "RepoNotFound", "Repository not found")
                return None, None
            sha = repo.refs.get(rev) or (rev if rev in repo.commits else None)
            if sha is None:
                self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
                return None, None
            if files and repo.gated and self._token() not in repo.granted_tokens:
                kind, name = (
                    ("dataset", repo_id.split("/", 1)[1]) if repo_id.startswith("datasets/") else ("model", repo_id)
                )
                if self._token():
                    self._error(
                        403,
                        "GatedRepo",
                        f"Access to {kind} {name} is restricted and you are not in the authorized list. "
                        f"Visit https://huggingface.co/{repo_id} to ask for access.",
                    )
                else:
                    self._error(
                        401,
                        "GatedRepo",
                        f"Access to {kind} {name} is restricted. You must have access to it and be "
                        "authenticated to access it. Please log in.",
                    )
                return None, None
            return repo, sha

        def _model_info(self, repo_id: str, rev: str, blobs: bool) -> None:
            repo, sha = self._lookup(repo_id, rev, files=False)  # model info is public, even for gated repos
            if repo is None:
                return
            siblings = []
            for name, data in sorted(repo.commits[sha].items()):
                entry: dict = {"rfilename": name}
                if blobs:
                    entry.update(size=len(data), blobId=git_blob_sha1(data))
                    if is_lfs(name):
                        entry["lfs"] = {
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        }
                siblings.append(entry)
            plain_id = repo_id.removeprefix("datasets/")
            info = {
                "id": plain_id,
                "sha": sha,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "siblings": siblings,
            }
            if plain_id == repo_id:
                info["modelId"] = repo_id
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body=True)

        def _resolve(self, repo_id: str, rev: str, filename: str, body: bool) -> None:
            repo, sha = self._lookup(repo_id, rev, files=True)
            if repo is None:
                return
            data = repo.commits[sha].get(filename)
            if data is None or filename in hub.hidden:
                self._error(404, "EntryNotFound", f'{filename} does not exist on "{rev}"', commit=sha)
                return
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(data)}"'}
            if is_lfs(filename):
                digest = hashlib.sha256(data).hexdigest()
                headers.update(
                    {
                        "Location": f"{hub.cdn}/cdn/{digest}?expires=never",
                        "X-Linked-Etag": f'"{digest}"',
                        "X-Linked-Size": str(len(data)),
                    }
                )
                self._send(302, b"", headers, body=body)
                return
            status, data, ranged = self._ranged(data)
            self._send(status, data, {**headers, **ranged}, body=body)

        def _entries(self, repo: Repo, sha: str) -> dict[str, dict]:
            """Every file and folder of a commit, as the tree and paths-info APIs describe them."""
            entries: dict[str, dict] = {}
            for name, data in repo.commits[sha].items():
                entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
                if is_lfs(name):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries[name] = entry
                parts = name.split("/")[:-1]
                for depth in range(1, len(parts) + 1):
                    folder = "/".join(parts[:depth])
                    entries.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                            "path": folder,
                        },
                    )
            return entries

        def _tree(self, key: str, rev: str, folder: str, recursive: bool) -> None:
            repo, sha = self._lookup(key, rev, files=False)
            if repo is None:
                return
            entries = self._entries(repo, sha)
            folder = folder.strip("/")
            if folder and entries.get(folder, {}).get("type") != "directory":
                self._error(404, "EntryNotFound", f'{folder} does not exist on "{rev}"', commit=sha)
                return
            prefix = folder + "/" if folder else ""
            listed = [
                e
                for path, e in sorted(entries.items())
                if path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])
            ]
            self._send(
                200, json.dumps(listed).encode(), {"Content-Type": "application/json", "X-Repo-Commit": sha}, body=True
            )

        def _paths_info(self, key: str, rev: str, paths: list[str]) -> None:
            repo, sha = self._lookup(key, rev, files=False)
            if repo is None:
                return
            entries = self._entries(repo, sha)
            found = [entries[p.strip("/")] for p in paths if p.strip("/") in entries]
            self._send(
                200, json.dumps(found).encode(), {"Content-Type": "application/json", "X-Repo-Commit": sha}, body=True
            )

        def _ranged(self, data: bytes) -> tuple[int, bytes, dict[str, str]]:
            """(status, body, headers) for ``data``, cut to the request's ``Range`` when it has one."""
            header = self.headers.get("Range")
            if not (header and header.startswith("bytes=")):
                return 200, data, {"Accept-Ranges": "bytes"}
            first, _, last = header[len("bytes=") :].partition("-")
            start = int(first or 0)
            end = min(int(last), len(data) - 1) if last else len(data) - 1
            chunk = data[start : end + 1]
            return (
                206,
                chunk,
                {"Content-Range": f"bytes {start}-{start + len(chunk) - 1}/{len(data)}", "Accept-Ranges": "bytes"},
            )

        def _cdn(self, segments: list[str], body: bool) -> None:
            entry = hub.blobs.get(segments[1]) if len(segments) == 2 and segments[0] == "cdn" else None
            if entry is None:
                self._error(404, None, "No such blob")
                return
            name, data = entry
            status, chunk, headers = self._ranged(data)
            with hub._lock:
                cut = body and hub.drop.get(name, 0) > 0
                if cut:
                    hub.drop[name] -= 1
                flip = body and hub.corrupt.get(name, 0) > 0
                if flip:
                    hub.corrupt[name] -= 1
            if flip:
                chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
            if not cut:
                self._send(status, chunk, headers, body=body)
                return
            # Promise the whole answer, send half of it, then close: a connection dropped mid-file.
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(chunk)))
            self.end_headers()
            self.wfile.write(chunk[: len(chunk) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        # -- helpers --------------------------------------------------------------------------

        def _token(self) -> str | None:
            value = self.headers.get("Authorization") or ""
            return value[len("Bearer ") :] if value.startswith("Bearer ") else None

        def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers, body=self.command != "HEAD")

        def _send(self, status: int, data: bytes, headers: dict[str, str], *, body: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and data:
                self.wfile.write(data)

    return Handler


def _key(kind: str, repo_id: str) -> str:
    """The :attr:`LocalHub.repos` key of ``/api/{kind}/{repo_id}`` (kind: models or datasets)."""
    return repo_key(repo_id, "dataset" if kind == "datasets" else "model")

#!/usr/bin/env python3
"""A FAKE Hugging Face hub: a local folder served over HTTP with the endpoints that
huggingface_hub's `snapshot_download` and datasets' `load_dataset` call, so the real clients
(and kvbench's prefetch) run here, where the real hub cannot be reached.

Not a hub anyone should use. Layout of the served folder:

    ROOT/models/<org>/<name>/<files>      a model repo
    ROOT/datasets/<org>/<name>/<files>    a dataset repo
    <repo>/.fake_hub.json                 optional: {"gated": "manual", "license": "llama3.1",
                                          "tokens": ["hf_..."]}: files are refused (403,
                                          X-Error-Code GatedRepo) unless the request carries one
                                          of those tokens, as the hub does before a licence
                                          is accepted

Every repo has one revision, `main`, whose commit hash is a hash of its files. Requests are
appended to ROOT/requests.log (method, path, whether a token came).
Usage: python tests/fake_hub/fake_hub.py ROOT  (prints the URL; HF_ENDPOINT=<URL> for clients)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

META = ".fake_hub.json"
KINDS = {"models": "model", "datasets": "dataset"}


def file_sha1(path: Path) -> str:
    stat = path.stat()
    return _sha1(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=None)
def _sha1(path: Path, size: int, mtime_ns: int) -> str:  # size and time: a changed file hashes anew
    digest = hashlib.sha1()
    with open(path, "rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Repo:
    def __init__(self, root: Path, kind: str, repo_id: str) -> None:
        self.kind, self.repo_id, self.folder = kind, repo_id, root / kind / repo_id
        meta = self.folder / META
        self.meta: dict[str, Any] = json.loads(meta.read_text()) if meta.is_file() else {}

    def exists(self) -> bool:
        return self.folder.is_dir()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file() and p.name != META)

    def commit(self) -> str:
        digest = hashlib.sha1()
        for name in self.files():
            digest.update(name.encode() + b"\0" + file_sha1(self.folder / name).encode())
        return digest.hexdigest()

    def allows(self, token: str | None) -> bool:
        return not self.meta.get("gated") or token in self.meta.get("tokens", [])

    def entry(self, path: str) -> dict[str, Any]:
        target = self.folder / path
        if target.is_dir():
            return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}
        return {"type": "file", "oid": file_sha1(target), "size": target.stat().st_size, "path": path}

    def info(self) -> dict[str, Any]:
        card = {"license": self.meta["license"]} if "license" in self.meta else {}
        return {
            "id": self.repo_id,
            "_id": self.repo_id,
            "sha": self.commit(),
            "private": False,
            "gated": self.meta.get("gated", False),
            "disabled": False,
            "cardData": card,
            "tags": [],
            "siblings": [{"rfilename": f} for f in self.files()],
            "lastModified": "2026-01-01T00:00:00.000Z",
        }


class Handler(BaseHTTPRequestHandler):
    root: Path

    def log_message(self, *args: Any) -> None:  # quiet: requests go to requests.log
        pass

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _log(self) -> None:
        with open(self.root / "requests.log", "a") as log:
            log.write(f"{self.command} {self.path} token={'yes' if self._token() else 'no'}\n")

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _error(self, status: int, code: str, message: str) -> None:
        self._json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, kind: str, parts: list[str]) -> tuple[Repo | None, list[str]]:
        if len(parts) < 2:
            return None, parts
        repo = Repo(self.root, kind, "/".join(parts[:2]))
        if not repo.exists():
            self._error(404, "RepoNotFound", f"Repository {repo.repo_id} not found")
            return None, parts
        return repo, parts[2:]

    def _revision_ok(self, repo: Repo, revision: str) -> bool:
        if unquote(revision) in ("main", repo.commit()):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return False

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._log()
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
        if parts[:1] == ["api"] and len(parts) > 1 and parts[1] in KINDS:
            return self._api(parts[1], parts[2:], parse_qs(url.query))
        kind = "datasets" if parts[:1] == ["datasets"] else "models"
        repo, rest = self._repo(kind, parts[1:] if kind == "datasets" else parts)
        if repo is None:
            return
        if len(rest) < 3 or rest[0] != "resolve" or not self._revision_ok(repo, rest[1]):
            return self._error(404, "EntryNotFound", "not found")
        return self._file(repo, "/".join(rest[2:]))

    def do_POST(self) -> None:
        self._log()
        parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/") if p]
        if len(parts) < 6 or parts[0] != "api" or parts[1] not in KINDS or parts[4] != "paths-info":
            return self._error(404, "EntryNotFound", "not found")
        repo, _ = self._repo(parts[1], parts[2:])
        if repo is None or not self._revision_ok(repo, parts[5]):
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        is_json = self.headers.get("Content-Type", "").startswith("application/json")
        form = json.loads(body) if is_json else parse_qs(body)
        paths = form.get("paths", [])
        paths = [paths] if isinstance(paths, str) else paths
        self._json([repo.entry(p) for p in paths if (repo.folder / p).exists()])

    def _api(self, kind: str, parts: list[str], query: dict[str, list[str]]) -> None:
        repo, rest = self._repo(kind, parts)
        if repo is None:
            return
        if not rest:
            return self._json(repo.info())
        if rest[0] == "revision" and len(rest) == 2:
            return self._json(repo.info()) if self._revision_ok(repo, rest[1]) else None
        if rest[0] == "tree" and len(rest) >= 2:
            if not self._revision_ok(repo, rest[1]):
                return
            base = "/".join(rest[2:])
            folder = repo.folder / base
            if not folder.is_dir():
                return self._error(404, "EntryNotFound", f"{base} does not exist")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            found = folder.rglob("*") if recursive else folder.iterdir()
            return self._json([repo.entry(str(p.relative_to(repo.folder))) for p in sorted(found) if p.name != META])
        return self._error(404, "EntryNotFound", "unknown endpoint")

    def _file(self, repo: Repo, path: str) -> None:
        if not repo.allows(self._token()):
            return self._error(
                403,
                "GatedRepo",
                f"Access to model {repo.repo_id} is restricted. You must have access "
                "to it and be authenticated to access it. Please log in.",
            )
        target = repo.folder / path
        if not target.is_file() or target.name == META:
            return self._error(404, "EntryNotFound", f"{path} does not exist on main")
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(target.stat().st_size))
        self.send_header("X-Repo-Commit", repo.commit())
        self.send_header("ETag", f'"{file_sha1(target)}"')
        self.end_headers()
        if self.command != "HEAD":
            with open(target, "rb") as data:
                shutil.copyfileobj(data, self.wfile)


def serve(root: Path, port: int = 0) -> ThreadingHTTPServer:
    """Start serving `root` on 127.0.0.1 in a daemon thread; the caller shuts it down."""
    handler = type("FakeHubHandler", (Handler,), {"root": root.resolve()})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="fake-hub").start()
    return server


def main() -> int:
    server = serve(Path(sys.argv[1]))
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

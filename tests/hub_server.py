"""A loopback Hugging Face hub for tests: the HTTP endpoints `huggingface_hub` itself calls to
download a snapshot and to create a repository and commit files to it, over repositories kept
in memory. Point the real client at it with HF_ENDPOINT=http://127.0.0.1:PORT.

Served: GET /api/models/{repo}/revision/{rev} (repo info), GET /api/models/{repo}/tree/{rev}
(file listing), HEAD/GET /{repo}/resolve/{rev}/{path} (files, with X-Repo-Commit and ETag),
POST /api/repos/create, POST /api/models/{repo}/preupload/{rev} (every file "regular"),
POST /api/models/{repo}/commit/{rev} (NDJSON with base64 file contents). Every request's
Authorization header is recorded, so tests can check that the token was sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Hub:
    """Repositories (repo id -> {path: bytes}) and the server that serves them."""

    def __init__(self, require_token: str | None = None) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.require_token = require_token
        self.auth: list[str | None] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_dir(self, repo_id: str, folder: Path) -> None:
        """Publish every file under `folder` as repo `repo_id`."""
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
                 if p.is_file() and not p.name.startswith(".")}
        self._commit(repo_id, files)

    def _commit(self, repo_id: str, files: dict[str, bytes]) -> str:
        self.repos.setdefault(repo_id, {}).update(files)
        h = hashlib.sha1(repo_id.encode())
        for path, data in sorted(self.repos[repo_id].items()):
            h.update(path.encode() + hashlib.sha1(data).digest())
        self.commits[repo_id] = h.hexdigest()
        return self.commits[repo_id]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      head: bool = False) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, status: int, obj: object) -> None:
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization")
                hub.auth.append(auth)
                if hub.require_token is not None and auth != f"Bearer {hub.require_token}":
                    self._send(401, b'{"error": "Invalid credentials"}',
                               {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
                    return False
                return True

            def _repo(self, repo_id: str) -> dict[str, bytes] | None:
                if repo_id not in hub.repos:
                    self._send(404, b'{"error": "Repository not found"}',
                               {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"})
                    return None
                return hub.repos[repo_id]

            def _get(self, head: bool) -> None:
                if not self._authorized():
                    return
                path = self.path.split("?")[0]
                if m := re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path):
                    if (files := self._repo(m[1])) is not None:
                        self._json(200, {"id": m[1], "modelId": m[1], "sha": hub.commits[m[1]], "private": False,
                                         "siblings": [{"rfilename": f} for f in sorted(files)]})
                elif m := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)/?", path):
                    if (files := self._repo(m[1])) is not None:
                        self._json(200, [{"type": "file", "path": f, "size": len(d),
                                          "oid": hashlib.sha1(d).hexdigest()} for f, d in sorted(files.items())])
                elif m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                    files = self._repo(m[1])
                    if files is None:
                        return
                    data = files.get(m[3])
                    if data is None:
                        self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                        return
                    self._send(200, data, {"X-Repo-Commit": hub.commits[m[1]],
                                           "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                           "Content-Type": "application/octet-stream"}, head)
                else:
                    self._send(404, b"", head=head)

            def do_HEAD(self) -> None:  # noqa: N802
                self._get(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._get(head=False)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self._authorized():
                    return
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    if repo_id in hub.repos:
                        self._json(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                        return
                    hub._commit(repo_id, {})
                    self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                elif m := re.fullmatch(r"/api/models/(.+?)/preupload/([^/]+)", path):
                    if self._repo(m[1]) is not None:
                        files = json.loads(body)["files"]
                        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                   for f in files]})
                elif m := re.fullmatch(r"/api/models/(.+?)/commit/([^/]+)", path):
                    if self._repo(m[1]) is None:
                        return
                    files = {}
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            v = item["value"]
                            files[v["path"]] = base64.b64decode(v["content"])
                    oid = hub._commit(m[1], files)
                    self._json(200, {"commitUrl": f"{hub.url}/{m[1]}/commit/{oid}", "commitOid": oid,
                                     "success": True})
                else:
                    self._send(404)

        return Handler

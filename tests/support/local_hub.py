"""A stand-in for the Hugging Face hub on 127.0.0.1: a real HTTP server speaking the few endpoints that
``huggingface_hub.snapshot_download`` uses (point ``HF_ENDPOINT`` at it):

    GET        /api/models/{repo}[/revision/{revision}]    repo info: the commit sha and the file list
    GET        /api/models/{repo}/tree/{sha}?recursive=... the files with sizes and ids
    HEAD, GET  /{repo}/resolve/{revision}/{path}           metadata headers, then the bytes (Range honoured)

and the few that ``HfApi.create_repo`` and ``HfApi.upload_folder`` use to publish (``uploads``: a folder that
receives the repositories created here):

    POST       /api/repos/create                            create a repository (409 when it exists)
    POST       /api/validate-yaml                           a README's front matter, parsed by huggingface_hub
    POST       /api/models/{repo}/preupload/{revision}      every file "regular", with the oid of the one it holds
    POST       /api/models/{repo}/commit/{revision}         the commit, as NDJSON: its files, base64

It serves folders as repositories, records every request, and can cut a file's downloads short (``cut``:
path -> bytes per response) to make the client resume, and refuse resumed requests (``refuse_ranges``) to make
a download fail half-way. ``token``: the bearer token a write needs (401 without it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from support.json_http import JsonHandler


@dataclass
class LocalHub:
    repos: dict[str, Path]  # repo id -> folder
    cut: dict[str, int] = field(default_factory=dict)  # file path -> at most this many body bytes per response
    refuse_ranges: bool = False  # answer a resumed (Range) request with 503, as a hub that went down would
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)
    uploads: Path | None = None  # where repositories created through the API live
    token: str | None = None  # the token a write needs
    committed: list[list[str]] = field(default_factory=list)  # the files of each commit received, in order
    validated: list[str] = field(default_factory=list)  # the README texts the client asked to validate

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()  # a 40-hex commit id, stable per repo

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def __enter__(self) -> LocalHub:
        hub = self

        class Handler(JsonHandler):
            def not_found(self, what: str):
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", f"{what} not found")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def route(self):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if path == "/api/agent-harnesses":  # the client's registry of AI agents it names in its user agent
                    return self.send_json(200, {"standardEnvVars": [], "harnesses": {}})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path)
                if m:
                    repo, kind, _ = m.groups()
                    if repo not in hub.repos:
                        return self.not_found(repo)
                    files = hub.files(repo)
                    if kind != "tree":
                        return self.send_json(
                            200,
                            {
                                "id": repo,
                                "modelId": repo,
                                "sha": hub.sha(repo),
                                "private": False,
                                "siblings": [{"rfilename": name} for name in files],
                            },
                        )
                    return self.send_json(
                        200,
                        [
                            {
                                "type": "file",
                                "path": name,
                                "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                            }
                            for name, p in files.items()
                        ],
                    )
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not m or m.group(1) not in hub.repos or m.group(3) not in hub.files(m.group(1)):
                    return self.not_found(path)
                repo, _, name = m.groups()
                data = hub.files(repo)[name].read_bytes()
                start = 0
                if self.headers.get("Range"):
                    if hub.refuse_ranges:
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(re.match(r"bytes=(\d+)-", self.headers["Range"]).group(1))
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.sha(repo))
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(body)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "GET":
                    limit = hub.cut.get(name)
                    self.wfile.write(body if limit is None else body[:limit])
                    if limit is not None and limit < len(body):
                        self.close_connection = True  # the client sees the body end early

            do_GET = do_HEAD = route

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, None))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self.send_json(401, {"error": "Invalid credentials in Authorization header"})
                if path == "/api/validate-yaml":
                    from huggingface_hub import ModelCard

                    content = json.loads(body)["content"]
                    hub.validated.append(content)
                    try:
                        ModelCard(content)  # the metadata block parses as YAML the client's own card model reads
                    except ValueError as err:
                        return self.send_json(400, {"errors": [{"message": str(err)}], "warnings": []})
                    return self.send_json(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    asked = json.loads(body)
                    repo = f"{asked['organization']}/{asked['name']}" if asked.get("organization") else asked["name"]
                    if repo in hub.repos:
                        return self.send_json(409, {"error": "You already created this model repo", "url": repo})
                    assert hub.uploads is not None, "LocalHub(uploads=...) receives created repositories"
                    hub.repos[repo] = hub.uploads / repo
                    hub.repos[repo].mkdir(parents=True)
                    return self.send_json(200, {"url": f"{hub.url}/{repo}", "name": repo})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
                if not m or m.group(1) not in hub.repos:
                    return self.not_found(path)
                repo, kind, _ = m.groups()
                held = hub.files(repo)
                if kind == "preupload":
                    asked = json.loads(body)["files"]
                    return self.send_json(
                        200,
                        {
                            "files": [
                                {
                                    "path": f["path"],
                                    "uploadMode": "regular",
                                    "shouldIgnore": False,
                                    "oid": git_hash(held[f["path"]].read_bytes()) if f["path"] in held else None,
                                }
                                for f in asked
                            ]
                        },
                    )
                names = []
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        target = hub.repos[repo] / item["value"]["path"]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(base64.b64decode(item["value"]["content"]))
                        names.append(item["value"]["path"])
                hub.committed.append(names)
                sha = hashlib.sha1(f"{repo}{len(hub.committed)}".encode()).hexdigest()
                return self.send_json(
                    200, {"success": True, "commitOid": sha, "commitUrl": f"{hub.url}/{repo}/commit/{sha}"}
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GET requests for file ``name`` (None: from the start)."""
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith("/" + name)]


def git_hash(data: bytes) -> str:
    """A file's git blob id, which the Hub returns as a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

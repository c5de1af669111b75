"""The request handler the tests' stand-in servers share (vLLM, SGLang, the hub, a broken feature server):
quiet, and answering JSON (or a body of another type, Prometheus text) with its length."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(obj).encode(), "application/json", headers)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

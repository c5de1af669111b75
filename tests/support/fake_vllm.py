"""A vLLM-shaped OpenAI server for the generate tests and the client benchmark: real HTTP on 127.0.0.1.

Serves ``/v1/models`` (id, root, max_model_len), ``/health``, ``/version`` and ``/v1/chat/completions``.
Where the reply's reasoning goes is switchable (``shape``), as servers differ (docs/formats.md §5):

    reasoning          ``message.reasoning`` only (vLLM ≥ 0.16)
    both               ``reasoning`` and ``reasoning_content`` (vLLM 0.11–0.15)
    reasoning_content  ``reasoning_content`` only (SGLang, older vLLM)
    inline             ``<think>…</think>`` inside ``content`` (no reasoning parser)
    close_only         ``…</think>`` inside ``content`` (the template opened ``<think>`` in the prompt)
    empty              no reasoning anywhere (``reasoning: null``), as with a missing ``--reasoning-parser``
    thinking           ``message.thinking``: a field no reader should be expected to know

Faults are injected by the number of the chat request (1-based) or for every request:
``500``, ``503``, ``429`` (with Retry-After), ``slow`` (answers after ``slow_seconds``), ``reset``
(the connection is reset mid-response), ``malformed`` (a 200 whose body is not JSON), ``length``
(cut at max_tokens: ``finish_reason: length``), ``400``. ``strict`` refuses vLLM's ``return_token_ids``
with a 422, as transformers serve does. Answers are derived from the prompt, so a test
can check every record against its prompt.

Prompt tokens are counted by words, or — given ``tokenizer`` (a model folder) — as vLLM counts them: the chat
template rendered with the generation prompt and tokenized, after a ``system_prompt`` turn when one is set (a
server that renders prompts another way than the target's template); ``tokenize`` serves vLLM's ``/tokenize``. ``python tests/support/fake_vllm.py`` serves one from the command line.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from support.json_http import JsonHandler

SHAPES = ("reasoning", "both", "reasoning_content", "inline", "close_only", "empty", "thinking")
FAULTS = ("500", "503", "429", "slow", "reset", "malformed", "length", "400")


def answer(messages: list[dict]) -> tuple[str, str]:
    """The deterministic (reasoning, content) for a prompt: derived from its last user turn."""
    text = next(m["content"] for m in reversed(messages) if m.get("role") == "user")
    words = text.split()
    return (
        f"The question has {len(words)} words. Reversed it reads: {' '.join(reversed(words))}.",
        f"Answer: {len(words)} words, first {words[0] if words else '-'}.",
    )


def count_tokens(text: str) -> int:
    return len(text.split())


class FakeVLLM:
    """Start with ``.start()`` (or as a context manager); ``.url`` is the base URL ending in /v1."""

    def __init__(
        self,
        model: str = "fake/reasoner",
        shape: str = "reasoning",
        max_model_len: int = 4096,
        version: str = "0.17.0",
        faults: dict[int, str] | None = None,
        fault_all: str | None = None,
        retry_after: float = 1,
        slow_seconds: float = 2.0,
        delay: float = 0.0,
        api_key: str | None = None,
        strict: bool = False,
        health_status: int = 200,
        tokenizer: str | None = None,
        system_prompt: str | None = None,
        tokenize: bool = False,
    ):
        assert shape in SHAPES, shape
        self.model, self.shape, self.max_model_len, self.version = model, shape, max_model_len, version
        self.faults, self.fault_all = dict(faults or {}), fault_all
        self.retry_after, self.slow_seconds, self.delay, self.api_key = retry_after, slow_seconds, delay, api_key
        self.strict = strict  # refuse fields vLLM alone knows, as transformers serve does (422)
        self.health_status = health_status  # vLLM answers 503 on /health once its engine died
        self.tokenizer = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.system_prompt, self.tokenize = system_prompt, tokenize
        self.requests: list[dict[str, Any]] = []  # chat requests: n, t, headers, body, fault
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    # --- lifecycle ---
    def start(self, port: int = 0) -> FakeVLLM:
        fake = self

        class Handler(_Handler):
            server_state = fake

        self._httpd = _Server(("127.0.0.1", port), Handler)
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeVLLM:
        return self.start() if self._httpd is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # --- behaviour ---
    def next_request(self, headers: dict, body: Any) -> tuple[int, str | None]:
        with self._lock:
            n = len(self.requests) + 1
            fault = self.faults.get(n, self.fault_all)
            self.requests.append({"n": n, "t": time.monotonic(), "headers": headers, "body": body, "fault": fault})
            return n, fault

    def message(self, reasoning: str, content: str) -> dict[str, Any]:
        shape = self.shape
        if shape == "reasoning":
            return {"role": "assistant", "content": content, "reasoning": reasoning}
        if shape == "both":
            return {"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_content": reasoning}
        if shape == "reasoning_content":
            return {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if shape == "inline":
            return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{content}"}
        if shape == "close_only":
            return {"role": "assistant", "content": f"{reasoning}\n</think>\n\n{content}"}
        if shape == "thinking":
            return {"role": "assistant", "content": content, "thinking": reasoning}
        return {"role": "assistant", "content": content, "reasoning": None}

    def prompt_ids(self, body: dict) -> list[int] | None:
        """The prompt's token ids as this server renders it (None without a tokenizer: counted by words)."""
        if self.tokenizer is None:
            return None
        messages = body.get("messages") or []
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(body.get("chat_template_kwargs") or {})
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def completion(self, body: dict, fault: str | None) -> tuple[int, dict]:
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        messages = body.get("messages") or []
        ids = self.prompt_ids(body)
        prompt_tokens = (
            len(ids)
            if ids is not None
            else sum(count_tokens(m.get("content") or "") for m in messages) + 3 * len(messages)
        )
        max_tokens = int(body.get("max_tokens") or 16)
        if prompt_tokens + max_tokens > self.max_model_len:
            return 400, {
                "error": {
                    "message": f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {prompt_tokens + max_tokens} tokens.",
                    "code": 400,
                }
            }
        reasoning, content = answer(messages)
        budget = 0 if fault == "length" else max_tokens
        finish = "stop"
        if count_tokens(reasoning) + count_tokens(content) > budget:  # cut at max_tokens, as a server does
            finish, words = "length", reasoning.split()[: max(1, budget)]
            reasoning, content = " ".join(words), ""
        message = self.message(reasoning, content)
        if finish == "length" and self.shape in ("inline", "close_only"):  # the reasoning never got closed
            message["content"] = ("<think>\n" if self.shape == "inline" else "") + reasoning
        completion_tokens = count_tokens(reasoning) + count_tokens(content)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        out = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = [len(w) for w in f"{reasoning} {content}".split()]
            out["prompt_token_ids"] = ids if ids is not None else list(range(prompt_tokens))
        return 200, out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        pass  # clients that went away (timeouts, resets) are part of the tests


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else headers and body in two writes meet the client's delayed ACK: 40 ms each
    server_state: FakeVLLM

    def do_GET(self) -> None:
        fake = self.server_state
        if self.path == "/health":
            self.send_json(fake.health_status, {})
        elif self.path == "/version":
            self.send_json(200, {"version": fake.version})
        elif self.path == "/v1/models":
            if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                self.send_json(401, {"error": {"message": "Unauthorized"}})
                return
            self.send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": fake.model,
                            "object": "model",
                            "owned_by": "vllm",
                            "root": fake.model,
                            "max_model_len": fake.max_model_len,
                        }
                    ],
                },
            )
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        fake = self.server_state
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/tokenize" and fake.tokenize and fake.tokenizer is not None:
            ids = fake.prompt_ids(json.loads(raw))
            self.send_json(200, {"count": len(ids), "max_model_len": fake.max_model_len, "tokens": ids})
            return
        if self.path != "/v1/chat/completions":
            self.send_json(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            self.send_json(400, {"error": {"message": "invalid JSON body"}})
            return
        _, fault = fake.next_request(dict(self.headers), body)
        if fake.delay:
            time.sleep(fake.delay)
        if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
            self.send_json(401, {"error": {"message": "Unauthorized"}})
        elif fake.strict and "return_token_ids" in body:
            self.send_json(422, {"detail": "Unexpected fields in the request: {'return_token_ids'}"})
        elif fault in ("500", "503", "400"):
            self.send_json(int(fault), {"error": {"message": f"injected {fault}"}})
        elif fault == "429":
            self.send_json(429, {"error": {"message": "rate limited"}}, {"Retry-After": f"{fake.retry_after:g}"})
        elif fault == "malformed":
            self.send_body(200, b'{"id": "chatcmpl-fake", "choices": [{"message": ', "application/json")
        elif fault == "reset":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "4096")
            self.end_headers()
            self.wfile.write(b'{"id": "chatcmpl-fake", "choi')
            self.wfile.flush()
            # SO_LINGER 0: close() sends a TCP reset instead of a clean end of stream
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        else:
            if fault == "slow":
                time.sleep(fake.slow_seconds)
            status, out = fake.completion(body, fault)
            self.send_json(status, out)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--shape", default="reasoning", choices=SHAPES)
    ap.add_argument("--model", default="fake/reasoner")
    args = ap.parse_args()
    fake = FakeVLLM(model=args.model, shape=args.shape).start(args.port)
    print(fake.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()

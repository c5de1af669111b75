"""The chat-completions client of the generate stage: async httpx against one or more OpenAI-compatible servers.

Each request goes to the server with the fewest requests in flight (at most ``concurrency`` per server).
Connection errors, timeouts, 429 (after its Retry-After), 5xx and malformed JSON are retried with jittered
exponential backoff, on whichever server is free then. A server that fails ``DOWN_AFTER`` times in a row
is taken out of rotation and probed again with a single request after ``probe_interval`` seconds (doubling
while it keeps failing); when every server has been out for ``outage_timeout`` seconds the run stops,
naming each server's last error. Other 4xx answers are the request's own fault: no retry.

The API key is read from the environment by name and sent as a Bearer header; it is scrubbed from every
error text, so it cannot reach a log, the ledger or errors.jsonl.

``chat`` is the generate stage's request; ``post`` sends any JSON body to any endpoint with the same
scheduling and retries (the extract stage's vLLM backend uses it for ``/completions``). The settings are
read by attribute (``servers``, ``concurrency``, ``timeout``, ``max_retries``, ``retry_backoff``,
``probe_interval``, ``outage_timeout``): a GenerateConfig, or any section with those fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from eaglekit.config import GenerateConfig
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.progress import console

DOWN_AFTER = 3  # consecutive failures that take a server out of rotation
MAX_BACKOFF = 60.0
MAX_PROBE_INTERVAL = 600.0


class RequestFailed(Exception):
    """A request that failed for good: its retries are spent, or the server refused it (4xx)."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(reason)
        self.reason, self.attempts = reason, attempts


class _AttemptFailed(Exception):
    def __init__(self, reason: str, retry: bool, server_fault: bool, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.retry, self.server_fault, self.retry_after = reason, retry, server_fault, retry_after


@dataclass
class Server:
    url: str  # base URL, ending in /v1
    capacity: int
    probe_interval: float
    inflight: int = 0
    failures: int = 0  # consecutive
    out_since: float | None = None  # when it was taken out of rotation; None while in
    retry_at: float = 0.0  # when an out server may get its probe request
    times_out: int = 0
    completed: int = 0
    last_error: str = ""

    @property
    def root(self) -> str:
        """The server's root URL (where vLLM serves /version and SGLang /get_model_info)."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def free_slots(self, now: float) -> int:
        if self.out_since is None:
            return self.capacity - self.inflight
        return 1 - self.inflight if now >= self.retry_at else 0  # one probe request at a time


@dataclass
class Reply:
    data: dict[str, Any]  # the response JSON
    server: str
    attempts: int


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: either delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class ChatClient:
    """Use as ``async with ChatClient(cfg, api_key) as client: reply = await client.chat(messages)``."""

    def __init__(self, cfg: GenerateConfig, api_key: str | None = None):
        self.cfg, self.api_key = cfg, api_key
        self.servers = [Server(u.rstrip("/"), cfg.concurrency, cfg.probe_interval) for u in cfg.servers]
        self.send_token_ids = getattr(cfg, "return_token_ids", False)
        self._http: httpx.AsyncClient | None = None
        self._changed: asyncio.Event | None = None

    async def __aenter__(self) -> ChatClient:
        total = sum(s.capacity for s in self.servers)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.cfg.timeout, connect=min(10.0, self.cfg.timeout)),
            limits=httpx.Limits(max_connections=total + len(self.servers), max_keepalive_connections=total),
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
        )
        self._changed = asyncio.Event()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session()[0].aclose()

    def _session(self) -> tuple[httpx.AsyncClient, asyncio.Event]:
        """The HTTP client and the slot-release event, which exist inside ``async with`` only."""
        if self._http is None or self._changed is None:
            raise RuntimeError("ChatClient is used outside `async with ChatClient(...)`")
        return self._http, self._changed

    def _wake_waiters(self) -> None:
        """Wake every request waiting for a slot; each re-checks the servers."""
        changed = self._session()[1]
        changed.set()
        changed.clear()

    def scrub(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text

    def body(self, messages: list[dict]) -> dict[str, Any]:
        g = self.cfg
        body: dict[str, Any] = {
            "model": g.model,
            "messages": messages,
            "max_tokens": g.max_tokens,
            "temperature": g.temperature,
            "top_p": g.top_p,
        }
        if g.temperature > 0:
            body["seed"] = g.seed
        if self.send_token_ids:
            body["return_token_ids"] = True
        return {**body, **g.extra_body}

    # --- scheduling -------------------------------------------------------------------------------
    # All of it runs on the event loop's one thread: no await between looking at a server and taking
    # its slot, so no lock is needed; a release pulses an Event to wake the requests waiting for a slot.

    async def _acquire(self) -> tuple[Server, bool]:
        """A server with a free slot (the least loaded), and whether this request is its probe."""
        while True:
            now = time.monotonic()
            free = [s for s in self.servers if s.free_slots(now) > 0]
            if free:
                server = min(free, key=lambda s: (s.inflight / s.capacity, s.inflight))
                server.inflight += 1
                return server, server.out_since is not None
            wake = now + 1.0
            out_since = [s.out_since for s in self.servers if s.out_since is not None]
            if len(out_since) == len(self.servers):  # every server is out of rotation
                since = max(out_since)
                if now - since >= self.cfg.outage_timeout:
                    raise EaglekitError(
                        f"no server left: every server has been out of rotation for {self.cfg.outage_timeout:g}s; "
                        + "; ".join(f"{s.url}: {self.scrub(s.last_error)}" for s in self.servers),
                        "check the servers (are they up? `curl BASE_URL/models`), then rerun the same command "
                        "to resume; completed samples are on disk",
                    )
                wake = min([s.retry_at for s in self.servers if s.inflight == 0] + [since + self.cfg.outage_timeout])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._session()[1].wait(), timeout=max(0.01, wake - now))

    def _release(self, server: Server, probe: bool, ok: bool, error: _AttemptFailed | None = None) -> None:
        server.inflight -= 1
        if ok and server.out_since is not None and not probe:
            server.completed += 1  # sent before it was taken out: only its probe request brings it back
        elif ok:
            if server.out_since is not None:
                console.print(f"[green]{server.url} answers again; back in rotation[/]")
            server.failures, server.out_since, server.completed = 0, None, server.completed + 1
            server.probe_interval = self.cfg.probe_interval
        elif error is not None and error.server_fault:
            server.failures += 1
            server.last_error = error.reason
            now = time.monotonic()
            if probe:  # the probe failed too: wait longer before the next one
                server.probe_interval = min(server.probe_interval * 2, MAX_PROBE_INTERVAL)
                server.retry_at = now + server.probe_interval
            elif server.out_since is None and server.failures >= DOWN_AFTER:
                server.out_since, server.retry_at = now, now + server.probe_interval
                server.times_out += 1
                console.print(
                    f"[yellow]{server.url} taken out of rotation after {server.failures} failures in a row "
                    f"({self.scrub(error.reason)}); probing it again in {server.probe_interval:g}s[/]"
                )
        self._wake_waiters()

    def take_out(self, url: str, reason: str) -> None:
        """Take a server out of rotation now, though its HTTP answer was fine: what it produced is unusable
        (e.g. a hidden-states file that never arrived whole). It gets a probe request after probe_interval."""
        server = next(s for s in self.servers if s.url == url.rstrip("/"))
        now = time.monotonic()
        server.last_error = reason
        if server.out_since is None:
            server.out_since, server.retry_at = now, now + server.probe_interval
            server.times_out += 1
            console.print(
                f"[yellow]{server.url} taken out of rotation ({self.scrub(reason)}); probing it again in "
                f"{server.probe_interval:g}s[/]"
            )
        else:
            server.probe_interval = min(server.probe_interval * 2, MAX_PROBE_INTERVAL)
            server.retry_at = now + server.probe_interval
        self._wake_waiters()

    # --- one request ------------------------------------------------------------------------------

    async def _attempt(self, server: Server, path: str, body: dict, check) -> dict[str, Any]:
        try:
            resp = await self._session()[0].post(server.url + path, json=body)
        except httpx.TimeoutException:
            raise _AttemptFailed(f"timed out after {self.cfg.timeout:g}s", retry=True, server_fault=True) from None
        except httpx.HTTPError as err:  # connection refused/reset, protocol errors: the server's side
            raise _AttemptFailed(f"{type(err).__name__}: {err}", retry=True, server_fault=True) from None
        if resp.status_code != 200:
            text = resp.text[:300].strip()
            code = resp.status_code
            if code == 429:
                raise _AttemptFailed(
                    f"HTTP 429 (rate limited): {text}",
                    retry=True,
                    server_fault=False,
                    retry_after=parse_retry_after(resp.headers.get("retry-after")),
                )
            if code >= 500 or code == 408:
                raise _AttemptFailed(
                    f"HTTP {code}: {text}",
                    retry=True,
                    server_fault=True,
                    retry_after=parse_retry_after(resp.headers.get("retry-after")),
                )
            raise _AttemptFailed(f"HTTP {code}: {text}", retry=False, server_fault=False)
        try:
            data = resp.json()
            check(data)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise _AttemptFailed(
                f"malformed response ({type(err).__name__}: {err}): {resp.text[:200]!r}", retry=True, server_fault=True
            ) from None
        return data

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        delay = min(MAX_BACKOFF, self.cfg.retry_backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
        return max(delay, retry_after or 0.0)

    async def chat(self, messages: list[dict]) -> Reply:
        """One chat completion, retried as the module says; raises RequestFailed when it fails for good."""
        return await self.post("/chat/completions", lambda: self.body(messages), _has_message)

    async def post(self, path: str, make_body, check=lambda data: None) -> Reply:
        """POST ``make_body()`` to ``path`` of a server (retried and rotated as the module says). ``check(data)``
        raises ValueError/KeyError/TypeError on a malformed answer, which counts as the server's fault."""
        attempt = 0
        while True:
            attempt += 1
            body = make_body()
            server, probe = await self._acquire()
            try:
                data = await self._attempt(server, path, body, check)
            except _AttemptFailed as failure:
                self._release(server, probe, ok=False, error=failure)
                if "return_token_ids" in failure.reason and body.get("return_token_ids") and not failure.retry:
                    # Only vLLM knows return_token_ids; servers that validate strictly (transformers serve) refuse it.
                    if self.send_token_ids:
                        console.print(
                            f"[yellow]{server.url} refuses `return_token_ids`; sending requests without it "
                            "(completion_token_ids will be missing)[/]"
                        )
                    self.send_token_ids = False
                    attempt -= 1
                    continue
                if not failure.retry or attempt > self.cfg.max_retries:
                    raise RequestFailed(self.scrub(f"{server.url}: {failure.reason}"), attempt) from None
                await asyncio.sleep(self._backoff(attempt, failure.retry_after))
                continue
            except BaseException:  # cancelled (Ctrl-C, a stopped run): free the slot, change nothing else
                self._release(server, probe, ok=False)
                raise
            self._release(server, probe, ok=True)
            return Reply(data, server.url, attempt)

    def rotation_report(self) -> list[str]:
        """One line per server that was taken out of rotation during the run."""
        return [
            f"{s.url}: taken out of rotation {s.times_out}x, last error: {self.scrub(s.last_error)}; "
            f"{s.completed} requests completed there"
            for s in self.servers
            if s.times_out
        ]


def _has_message(data: dict) -> None:
    if not isinstance(data["choices"][0]["message"], dict):
        raise TypeError("message is not an object")


def api_key_from_env(name: str | None, key: str) -> str | None:
    """The API key held by the environment variable ``name`` (config key ``key`` names it); None when unset."""
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise UsageError(
            f"{key} names {name}, which is not set in the environment",
            f"export {name}=... before running (the key itself never goes in the config)",
        )
    return value


# --- plain GETs for the pre-flight ----------------------------------------------------------------


def get_json(url: str, api_key: str | None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON or text) of a GET; raises httpx.HTTPError when the server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return _parsed(httpx.get(url, headers=headers, timeout=timeout))


def post_json(url: str, body: dict, api_key: str | None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON or text) of a POST of ``body``; raises httpx.HTTPError when the server cannot be
    reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return _parsed(httpx.post(url, json=body, headers=headers, timeout=timeout))


def _parsed(resp: httpx.Response) -> tuple[int, Any]:
    try:
        return resp.status_code, resp.json()
    except json.JSONDecodeError:
        return resp.status_code, resp.text[:300]


def served_prompt_ids(
    root: str, api_key: str | None, model: str, messages: list[dict], template_kwargs: dict | None = None
) -> list[int] | None:
    """The token ids a server makes of a chat prompt, from its ``/tokenize`` (vLLM's: the chat template rendered
    with the generation prompt); None where it has no such endpoint or answers in another shape."""
    body: dict[str, Any] = {"model": model, "messages": messages, "add_generation_prompt": True}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    try:
        status, data = post_json(root.rstrip("/") + "/tokenize", body, api_key)
    except httpx.HTTPError:
        return None
    tokens = data.get("tokens") if status == 200 and isinstance(data, dict) else None
    return tokens if isinstance(tokens, list) and all(type(t) is int for t in tokens) else None

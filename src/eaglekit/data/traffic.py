"""Served traffic as training data: the target's own replies to its users' prompts, read from a gateway's log.

A log line is one chat-completions exchange, in the shapes gateways write: the request and response bodies side by
side (``request``/``response``, LiteLLM's ``messages`` + ``response``, Portkey's and Helicone's wrapped bodies,
JSON-encoded payloads), or the plain ``{"messages": [...]}`` with the assistant's reply last. A line makes a sample
only when it is the run's target answering as it would in generate: the response's ``model`` is the run's, the
reply is whole (not cut at the client's ``max_tokens``), the request asked nothing the chat template cannot render
here (tools, other ``chat_template_kwargs``), and the server rendered the prompt as the target's chat template does
here (the served-template check, ``ServedPrompts``). Every other line is a reject named by ``file:line`` and why;
the reading refuses only a log of which no line is usable.

Samples are identified by their content (the conversation's hash), so an exchange logged twice is one sample and a
log that gained lines holds the old samples and some new ones. ``newest`` keeps the most recent conversations;
``max_samples`` takes a seeded sample that stays put when lines are appended (each conversation ranked by a
seeded hash of its id: a new line displaces an old one only where it ranks ahead of it). The served-template check
runs on the conversations selected, in the order of selection, until enough pass; only those are read whole a second
time, so a long log is streamed, never held.

The records are generate's (``responses.make_record``), plus ``source`` (``file:line``): generate copies them into
the run directory, and nothing of the log is kept anywhere else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eaglekit import atomic
from eaglekit.data.chat import TEMPLATE_REMEDY, ServedPrompts
from eaglekit.data.prompts import parse_prompt, prompt_key, set_identity
from eaglekit.data.responses import make_record
from eaglekit.errors import EaglekitError, UsageError

# Where gateways put the two bodies: a plain key, a wrapper with the body under ``body`` or ``json``, or the body
# JSON-encoded in a string (OpenPipe's reqPayload).
REQUEST_KEYS = ("request", "request_body", "providerRequest", "reqPayload")
RESPONSE_KEYS = ("response", "response_body", "providerResponse", "respPayload")
WRAPPED_BODY_KEYS = ("body", "json")
STATUS_KEYS = ("status", "status_code", "statusCode")
TIME_KEYS = ("startTime", "created", "timestamp")  # a line's own time where its response has no `created`

SHOWN_PER_REASON = 3  # file:line named per reject reason in the summary
IDENTITY_CACHE = ".traffic-identity.json"  # in the run directory: the selection's identity, by the log's state

# Reject reasons, a short phrase each for counting; the text after the colon says what the line held.
MALFORMED = "malformed"
NO_REPLY = "no reply"
FAILED = "failed request"
OTHER_MODEL = "another model"
TRUNCATED = "truncated"
NOT_RENDERABLE = "not renderable here"
TEMPLATE = "rendered otherwise"
REMEDIES = {  # reason -> what to do when no line of a log is usable for it
    OTHER_MODEL: "set data.traffic.model to the id these responses carry if they are the run's target's, or point "
    "data.traffic.path at the target's own log",
    TRUNCATED: "every reply was cut at the clients' max_tokens and never ended its turn: log traffic whose replies "
    "finished (finish_reason stop)",
    NOT_RENDERABLE: "eaglekit trains on plain chat turns: log conversations without tools, sent with the run's "
    "chat_template_kwargs (generate.extra_body.chat_template_kwargs)",
    FAILED: "the log holds failed requests only: point data.traffic.path at the successful exchanges",
}


@dataclass
class Reject:
    source: str  # file:line
    why: str  # the reason (MALFORMED, OTHER_MODEL, ...), a colon, and what the line held

    @property
    def reason(self) -> str:
        return self.why.split(":", 1)[0]


@dataclass
class TrafficRead:
    """What reading a log gave: the samples selected (generate's records, oldest first) and every line left out."""

    path: str
    samples: list[dict] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    lines: int = 0
    duplicates: int = 0  # usable lines whose conversation was already read (the first counts)
    unchecked_model: int = 0  # samples whose line carries no `model` (the plain form): their origin is unchecked
    unchecked_template: int = 0  # samples whose prompt the served-template check could not compare
    left_out: int = 0  # usable conversations that since/newest/max_samples did not select
    unfinished: list[str] = field(default_factory=list)  # file:line of a last line still being written (no newline)
    template_remedy: str = ""
    model: str | None = None  # the id the responses were checked against

    def by_reason(self) -> dict[str, list[Reject]]:
        out: dict[str, list[Reject]] = {}
        for r in self.rejects:
            out.setdefault(r.reason, []).append(r)
        return out

    def rejects_summary(self) -> str:
        """Each reason once: how many lines, the first few by file:line and what the first held."""
        parts = []
        for reason, rejects in sorted(self.by_reason().items(), key=lambda kv: -len(kv[1])):
            where = ", ".join(r.source for r in rejects[:SHOWN_PER_REASON]) + (
                ", …" if len(rejects) > SHOWN_PER_REASON else ""
            )
            detail = rejects[0].why.split(":", 1)[1].strip() if ":" in rejects[0].why else ""
            parts.append(f"{len(rejects)} {reason} ({where}{': ' + detail if detail else ''})")
        return "; ".join(parts)

    def summary(self) -> str:
        """One paragraph: what was read, kept and left out, and why."""
        text = f"{self.path}: {self.lines} lines, {len(self.samples)} conversations taken"
        if self.duplicates:
            text += f", {self.duplicates} repeated (the first counts)"
        if self.left_out:
            text += f", {self.left_out} not selected (data.traffic since/newest/max_samples)"
        if self.rejects:
            text += f"; {len(self.rejects)} rejected: {self.rejects_summary()}"
        if self.unfinished:
            text += (
                f"; {', '.join(self.unfinished)}: an unfinished last line (still being written?), left for the next run"
            )
        if self.unchecked_model:
            text += f"; {self.unchecked_model} taken without a `model` field (their origin is unchecked)"
        if self.unchecked_template:
            text += (
                f"; {self.unchecked_template} taken prompts could not be compared with the served rendering (no "
                "usage.prompt_tokens or prompt_token_ids in the response, or no local tokenizer)"
            )
        return text

    def require_usable(self) -> None:
        """Refuse a log of which no line is usable, naming why each was left out and what to do."""
        if self.samples:
            return
        if not self.lines:
            raise UsageError(f"{self.path}: no log lines", "point data.traffic.path at the gateway's JSONL log")
        reasons = self.by_reason()
        top = max(reasons, key=lambda r: len(reasons[r])) if reasons else None
        if top == OTHER_MODEL:
            seen = Counter(r.why.split("'")[1] for r in reasons[OTHER_MODEL] if r.why.count("'") >= 2)
            models = ", ".join(f"'{m}' ({n} lines)" for m, n in seen.most_common(3))
            where = ", ".join(r.source for r in reasons[OTHER_MODEL][:SHOWN_PER_REASON])
            others = [r for r in self.rejects if r.reason != OTHER_MODEL]
            raise UsageError(
                f"{self.path}: no usable conversation of {self.lines} lines: the responses' `model` field holds "
                f"{models} ({where}{', …' if len(reasons[OTHER_MODEL]) > SHOWN_PER_REASON else ''}), and the run's "
                f"target is served as '{self.model}'"
                + (f"; the other lines: {TrafficRead(self.path, rejects=others).rejects_summary()}" if others else ""),
                REMEDIES[OTHER_MODEL],
            )
        remedy = self.template_remedy if top == TEMPLATE else REMEDIES.get(top or "")
        raise UsageError(
            f"{self.path}: no usable conversation of {self.lines} lines"
            + (f": {self.rejects_summary()}" if self.rejects else "")
            + (f"; {self.left_out} usable ones not selected by data.traffic since/newest" if self.left_out else ""),
            remedy or "point data.traffic.path at a log of the target's chat completions (docs/traffic.md)",
        )


# --- one line ---------------------------------------------------------------------------------------


class _Bad(Exception):
    """A line that makes no sample; its message is the reject's ``why``."""


def _body(value: Any, what: str) -> dict | None:
    """A logged body: as it is, unwrapped from a gateway's envelope (``{"status": 200, "body": {...}}``), or decoded
    from a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Bad(f"{MALFORMED}: the {what} is a string that is not JSON") from None
    if not isinstance(value, dict):
        return None
    wrapped = next((value[k] for k in WRAPPED_BODY_KEYS if isinstance(value.get(k), (dict, str))), None)
    if wrapped is None:
        return value
    status = next((value[k] for k in STATUS_KEYS if isinstance(value.get(k), int)), None)
    if status is not None and status >= 400:
        raise _Bad(f"{FAILED}: the {what} has status {status}")
    return _body(wrapped, what)


def _first(row: dict, keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _time(response: dict | None, row: dict) -> float | None:
    """When the exchange happened (unix seconds): the response's ``created``, else the line's own time."""
    for value in ((response or {}).get("created"), *(row.get(k) for k in TIME_KEYS)):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) / (1000 if value > 1e11 else 1)  # milliseconds (OpenPipe) or seconds
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
                return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()
    return None


@dataclass
class _Exchange:
    """A usable line before the selection: where it is, and what selects it. Only the lines selected are read again
    and kept whole, so a long log is never held in memory."""

    order: int
    sample_id: str
    created: float | None
    source: str  # file:line
    file: int  # index into the log's files
    offset: int  # of the line in its file


def same_model(logged: str, expected: str) -> bool:
    """The logged `model` names the expected one: the same id, or one with a gateway's provider prefix or a
    server's folder path ahead of the other (``hosted_vllm/Qwen/Qwen3-8B``, ``/models/Qwen3-8B``)."""
    a, b = logged.strip().rstrip("/"), expected.strip().rstrip("/")
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def conversation_id(messages: list[dict], reasoning: str, content: str) -> str:
    """A conversation's identity: its prompt and the reply (reasoning and content), so the same exchange logged
    twice is one sample, wherever and whenever it was logged."""
    blob = json.dumps([messages, reasoning, content], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _exchange(row: Any, source: str, model: str | None, template_kwargs: dict | None) -> tuple[dict, dict | None]:
    """(the sample's record, the response body) of one log line; raises _Bad saying why it makes none."""
    if not isinstance(row, dict):
        raise _Bad(f"{MALFORMED}: not a JSON object")
    if row.get("status") == "failure" or isinstance(row.get("error"), (dict, str)) and row.get("error"):
        raise _Bad(f"{FAILED}: the gateway logged an error")
    status = next((row[k] for k in STATUS_KEYS if isinstance(row.get(k), int)), None)
    if status is not None and status >= 400:
        raise _Bad(f"{FAILED}: status {status}")
    request = _body(_first(row, REQUEST_KEYS), "request") or row
    response = _body(_first(row, RESPONSE_KEYS), "response")
    turns = request.get("messages", row.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise _Bad(f"{MALFORMED}: no request messages")
    if response is not None:
        if response.get("error"):
            raise _Bad(f"{FAILED}: an error response")
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _Bad(f"{NO_REPLY}: the response has no choices")
        choice = choices[0]
        if "delta" in choice and "message" not in choice:
            raise _Bad(f"{MALFORMED}: a streamed chunk, not the whole response (log the assembled response)")
        message, finish = choice.get("message"), choice.get("finish_reason")
        logged_model = response.get("model")
        usage: dict = response["usage"] if isinstance(response.get("usage"), dict) else {}
        token_ids = choice.get("token_ids") if isinstance(choice.get("token_ids"), list) else None
    else:  # the plain form: the reply is the last turn
        last = turns[-1]
        if not (isinstance(last, dict) and last.get("role") == "assistant"):
            raise _Bad(f"{NO_REPLY}: no response, and the last message is not the assistant's")
        message, turns = last, turns[:-1]
        finish, logged_model = row.get("finish_reason"), row.get("model")
        usage, token_ids = {}, None
    if not isinstance(message, dict):
        raise _Bad(f"{NO_REPLY}: the response's message is missing")
    if message.get("tool_calls") or message.get("function_call"):
        raise _Bad(f"{NOT_RENDERABLE}: the reply calls tools")
    if isinstance(logged_model, str) and model and not same_model(logged_model, model):
        raise _Bad(f"{OTHER_MODEL}: model '{logged_model}' (the run's target is served as '{model}')")
    if finish == "length":
        raise _Bad(f"{TRUNCATED}: finish_reason length (cut at the client's max_tokens)")
    # LiteLLM logs the request's other parameters apart from its messages
    sent = {**request, **(request["model_parameters"] if isinstance(request.get("model_parameters"), dict) else {})}
    if sent.get("tools") or sent.get("functions"):
        raise _Bad(f"{NOT_RENDERABLE}: the request offers tools, which the chat template renders into the prompt")
    asked_kwargs = sent.get("chat_template_kwargs") or None
    if asked_kwargs is not None and asked_kwargs != (template_kwargs or None):
        raise _Bad(
            f"{NOT_RENDERABLE}: the request sent chat_template_kwargs {json.dumps(asked_kwargs)}, the run renders with "
            f"{json.dumps(template_kwargs or {})} (generate.extra_body.chat_template_kwargs)"
        )
    if not isinstance(turns[-1], dict) or turns[-1].get("role") not in ("user", "human"):
        role = turns[-1].get("role") if isinstance(turns[-1], dict) else None
        raise _Bad(f"{NOT_RENDERABLE}: the request ends with a {role!r} turn, not the user's")
    try:
        prompt = parse_prompt({"messages": turns}, source)
    except ValueError as err:
        raise _Bad(f"{MALFORMED}: {err}") from None
    record, _ = make_record(
        "",
        prompt.messages,
        message,
        finish if isinstance(finish, str) else None,
        usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None,
        usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else None,
        logged_model if isinstance(logged_model, str) else "",
        None,
        token_ids,
    )
    if not (record["content"] or record["reasoning"]):
        raise _Bad(f"{NO_REPLY}: the reply is empty (no content, no reasoning)")
    record["id"] = conversation_id(record["messages"], record["reasoning"], record["content"])
    record["source"] = source
    return record, response


def _line(raw: bytes, source: str, model: str | None, template_kwargs: dict | None) -> tuple[dict, dict, dict | None]:
    """(the line's JSON, its sample's record, its response body); raises _Bad saying why it makes no sample."""
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _Bad(f"{MALFORMED}: not JSON ({err.msg} at column {err.colno})") from None
    except UnicodeDecodeError:
        raise _Bad(f"{MALFORMED}: not UTF-8 text") from None
    except RecursionError:
        raise _Bad(f"{MALFORMED}: nested too deep") from None
    record, response = _exchange(row, source, model, template_kwargs)
    return row, record, response


def log_files(path: str | os.PathLike) -> list[Path]:
    """The log's files: the file, or a folder's *.jsonl in name order (rotated logs: oldest first)."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.suffix == ".jsonl" and f.is_file())
    if not p.exists():
        raise UsageError(
            f"traffic log not found: {p}", "set data.traffic.path to the gateway's JSONL log (or a folder)"
        )
    return [p]


def _open(f: Path):
    try:
        return open(f, "rb")  # noqa: SIM115 - the callers close it; a long log is streamed
    except OSError as err:
        raise UsageError(f"{f}: cannot be read ({err.strerror or err})", "fix its permissions or the mount") from None


def _lines(files: list[Path]) -> Iterator[tuple[str, bytes, int, int]]:
    """(file:line, the line, the file's index, the line's offset) of each line that is not blank."""
    for index, f in enumerate(files):
        with _open(f) as handle:
            offset = 0
            for lineno, raw in enumerate(handle, start=1):
                if raw.strip():
                    yield f"{f}:{lineno}", raw, index, offset
                offset += len(raw)


def _read_again(exchange: _Exchange, handles: dict[int, Any], files: list[Path], model, kwargs) -> tuple[dict, Any]:
    """The selected line's record and response body, read again from where the first pass found it."""
    if exchange.file not in handles:
        handles[exchange.file] = _open(files[exchange.file])
    handle = handles[exchange.file]
    handle.seek(exchange.offset)
    try:
        _, record, response = _line(handle.readline(), exchange.source, model, kwargs)
    except _Bad:
        record = {}
    if record.get("id") != exchange.sample_id:
        raise UsageError(
            f"{exchange.source} changed while eaglekit read the log (rewritten or rotated in place)",
            "run the same command again: it reads the log as it stands then",
        )
    return record, response


# --- the log ----------------------------------------------------------------------------------------


def read_traffic(
    path: str | os.PathLike,
    *,
    model: str | None,
    served: Any = None,
    since: datetime | float | None = None,
    newest: int | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    template_kwargs: dict | None = None,
) -> TrafficRead:
    """The usable conversations of a gateway log, deduplicated and selected, and every line left out, named.

    ``model``: the id the responses must carry (None: not checked). ``served``: a ``chat.ServedPrompts`` for the
    served-template check (None: not checked). ``since``: only exchanges created at or after it. ``newest``: the N
    most recent (by ``created``, else log order). ``max_samples``: a seeded sample of N, stable under appended lines.
    """
    read = TrafficRead(path=str(path), model=model)
    files = log_files(path)
    usable: list[_Exchange] = []
    seen: set[str] = set()
    for source, raw, index, offset in _lines(files):
        read.lines += 1
        try:
            row, record, response = _line(raw, source, model, template_kwargs)
        except _Bad as bad:
            if not raw.endswith(b"\n") and str(bad).startswith(f"{MALFORMED}: not JSON"):
                read.unfinished.append(source)  # the gateway is still writing it: the next run takes it
                read.lines -= 1
                continue
            read.rejects.append(Reject(source, str(bad)))
            continue
        if record["id"] in seen:
            read.duplicates += 1
            continue
        seen.add(record["id"])
        usable.append(_Exchange(len(usable), record["id"], _time(response, row), source, index, offset))
    candidates = _since(usable, since, read)
    ranked = _ranked(candidates, newest, max_samples, seed)
    wanted = min(max_samples or newest or len(ranked), len(ranked))
    taken: list[tuple[int, dict]] = []
    handles: dict[int, Any] = {}
    try:
        for i, exchange in enumerate(ranked):
            if len(taken) == wanted:
                read.left_out += len(ranked) - i
                break
            record, response = _read_again(exchange, handles, files, model, template_kwargs)
            problem = None
            if served is not None and response is not None:
                local = served.local_ids(record["messages"])
                if local is None:
                    read.unchecked_template += 1
                else:
                    problem = served.mismatch(local, response)
                    unknown = (response.get("usage") or {}).get("prompt_tokens") is None
                    read.unchecked_template += unknown and "prompt_token_ids" not in response
            elif served is not None:
                read.unchecked_template += 1
            if problem:
                read.rejects.append(Reject(exchange.source, f"{TEMPLATE}: {problem}"))
                continue
            taken.append((exchange.order, record))
    finally:
        for handle in handles.values():
            handle.close()
    read.samples = [record for _, record in sorted(taken, key=lambda t: t[0])]
    read.unchecked_model = sum(not r["model"] for r in read.samples)
    read.rejects.sort(key=lambda r: _source_order(r.source, files))
    return read


def _source_order(source: str, files: list[Path]) -> tuple[int, int]:
    name, _, line = source.rpartition(":")
    index = next((i for i, f in enumerate(files) if str(f) == name), len(files))
    return index, int(line) if line.isdigit() else 0


def _since(usable: list[_Exchange], since: datetime | float | None, read: TrafficRead) -> list[_Exchange]:
    """The exchanges created at or after ``since``; those with no time are left out (and counted) when it is set."""
    if since is None:
        return usable
    if isinstance(since, datetime):
        since = (since if since.tzinfo else since.replace(tzinfo=UTC)).timestamp()
    kept = [x for x in usable if x.created is not None and x.created >= since]
    read.left_out += len(usable) - len(kept)
    return kept


def _ranked(candidates: list[_Exchange], newest: int | None, max_samples: int | None, seed: int) -> list[_Exchange]:
    """The candidates in the order they are taken: newest first when ``newest`` is set (by time where every one has
    it, else log order); for ``max_samples``, the newest ``newest`` (or all) ranked by a seeded hash of each
    conversation's id, so that lines appended to the log displace a taken conversation only where they rank ahead
    of it."""
    ranked = candidates
    if newest is not None:
        timed = all(x.created is not None for x in ranked)
        ranked = sorted(ranked, key=lambda x: ((x.created or 0.0) if timed else 0.0, x.order), reverse=True)
        if max_samples is not None:
            ranked = ranked[:newest]  # the window of recent traffic the sample is drawn from
    if max_samples is not None:
        ranked = sorted(ranked, key=lambda x: _rank(x.sample_id, seed))
    return ranked


def _rank(sample_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}\x00{sample_id}".encode()).hexdigest()


# --- the run's traffic ------------------------------------------------------------------------------


def traffic_model(cfg) -> str:
    """The id the run's target's responses carry in the log: data.traffic.model, else generate.model (the id it is
    served under), else target.model."""
    t = cfg.data.traffic
    return (t.model if t is not None else None) or cfg.generate.model or cfg.target.model


def template_kwargs(cfg) -> dict | None:
    return cfg.generate.extra_body.get("chat_template_kwargs") or None


def run_traffic(cfg) -> TrafficRead:
    """The run's traffic (``data.traffic`` of a RunConfig) read, checked against its target and chat template."""
    t = cfg.data.traffic
    if t is None:
        raise UsageError("data.traffic is not set", "set data.traffic.path to a gateway log (docs/traffic.md)")
    read = read_traffic(
        t.path,
        model=traffic_model(cfg),
        served=ServedPrompts(cfg),
        since=t.since,
        newest=t.newest,
        max_samples=t.max_samples,
        seed=t.seed,
        template_kwargs=template_kwargs(cfg),
    )
    read.template_remedy = TEMPLATE_REMEDY
    return read


def _state(files: list[Path]) -> list:
    out = []
    for f in files:
        st = f.stat()
        out.append([os.path.realpath(f), st.st_mtime_ns, st.st_size, st.st_ino])
    return out


def traffic_identity(cfg) -> dict:
    """The identity of the conversations the run takes from its traffic (their keys, as prompts are identified), the
    log's path kept for messages. Kept in the run directory by the log files' state and the settings that select
    and check, so `eaglekit status` does not read a long log again; a log that cannot be read is identified by its
    path and the reason."""
    t = cfg.data.traffic
    try:
        files = log_files(t.path)
        key = [
            _state(files),
            t.model_dump(mode="json"),
            traffic_model(cfg),
            template_kwargs(cfg),
            cfg.target.model,
            cfg.target.chat_template,
        ]
    except (UsageError, OSError) as err:
        return {"path": str(t.path), "unreadable": getattr(err, "message", str(err))}
    cache = Path(cfg.run_path) / IDENTITY_CACHE
    with contextlib.suppress(OSError, ValueError, AttributeError, KeyError):
        kept = json.loads(cache.read_text())
        if kept.get("key") == key:
            return kept["identity"]
    try:
        read = run_traffic(cfg)
    except EaglekitError as err:
        return {"path": str(t.path), "unreadable": err.message}
    prompts = set_identity([prompt_key(r["id"], r["messages"]) for r in read.samples], t.path)
    identity = {"path": prompts["path"], "conversations": prompts["prompts"], "sha": prompts["sha"]}
    if cache.parent.is_dir():
        with contextlib.suppress(OSError, EaglekitError):  # read-only, or full: read again next time
            atomic.write_json(cache, {"key": key, "identity": identity})
    return identity

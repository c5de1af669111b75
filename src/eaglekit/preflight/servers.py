"""Pre-flight checks of the generate stage: the servers, the context length, and one real request.

The smoke request goes through the same client and record builder as the run and judges the whole
record: reasoning present when required (else it names the fields the server did send), an answer
without leftover think tags, a finish reason, token counts, and — with the target tokenizer at hand —
the record rendered by ``render_sample`` with the reasoning inside the think tags, as training will see
it. It is the check that catches a server whose reasoning lands where nothing reads it before a long run.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from eaglekit.data.chat import (
    TEMPLATE_REMEDY,
    ServedPrompts,
    local_target_tokenizer,
    render_sample,
    response_prompt_ids,
    template_has_think_tags,
    template_text,
)
from eaglekit.data.prompts import run_prompts
from eaglekit.data.reasoning import (
    explain_missing_reasoning,
    has_think_tags,
    split_inline_think,
    target_reasoning_mode,
)
from eaglekit.data.responses import make_record
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.preflight import CheckResult, fail, ok, skip, warn
from eaglekit.preflight.dataset import prompt_tokens
from eaglekit.serving.client import ChatClient, RequestFailed, api_key_from_env, get_json, served_prompt_ids


def _api_key(cfg) -> str | None:
    return api_key_from_env(cfg.generate.api_key_env, "generate.api_key_env")


def prompts_loaded(ctx) -> CheckResult:
    """The whole prompt set loads (the generic check reads only its first rows)."""
    try:
        prompt_set = run_prompts(ctx.cfg)
    except EaglekitError as err:
        return fail("all prompts", err.message, err.remedy or "fix the prompts file")
    if not prompt_set.records:
        return fail(
            "all prompts",
            f"{ctx.cfg.data.prompts}: no usable prompts ({prompt_set.summary()})",
            "point data.prompts at a dataset with user turns",
        )
    return ok("all prompts", prompt_set.summary())


def reasoning_mode(ctx) -> CheckResult:
    try:
        mode, why = target_reasoning_mode(ctx.cfg)
    except EaglekitError as err:
        return fail(
            "reasoning",
            f"cannot tell whether the target reasons: {err.message}",
            (err.remedy or "") + "; or set generate.reasoning explicitly",
        )
    g = ctx.cfg.generate
    gate = (
        f"; the first {g.gate_samples} responses must have it (≤ {g.gate_max_empty_share:.0%} empty)"
        if mode == "required"
        else ""
    )
    return ok("reasoning", f"{mode}: {why}{gate}")


def api_key(ctx) -> CheckResult:
    name = ctx.cfg.generate.api_key_env
    if not name:
        return ok("API key", "none (generate.api_key_env is not set)")
    try:
        _api_key(ctx.cfg)
    except UsageError as err:
        return fail("API key", err.message, err.remedy or "")
    return ok("API key", f"read from ${name}")


def server_info(url: str, key: str | None, model: str) -> dict:
    """What a server says about itself: served models, our model's max_model_len, its version."""
    url = url.rstrip("/")
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    info: dict = {"url": url, "error": None, "remedy": "", "models": [], "max_model_len": None, "version": None}
    try:
        status, body = get_json(f"{url}/models", key)
    except httpx.HTTPError as err:
        info["error"] = f"cannot reach {url}/models ({type(err).__name__}: {err})"
        info["remedy"] = "start the server, or fix the host/port in generate.servers"
        return info
    if status in (401, 403):
        info["error"] = f"{url}/models answers HTTP {status}: the server wants an API key (or another one)"
        info["remedy"] = "set generate.api_key_env to the name of the env variable holding the key"
        return info
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        info["error"] = f"{url}/models answers HTTP {status} without a model list: {str(body)[:200]}"
        info["remedy"] = "generate.servers takes the OpenAI base URL, ending in /v1 (e.g. http://host:8000/v1)"
        return info
    info["models"] = [m for m in body["data"] if isinstance(m, dict)]
    ours = next((m for m in info["models"] if m.get("id") == model), None)
    if ours is not None:
        info["max_model_len"] = ours.get("max_model_len")
    for path, key_name, kind in (("/version", "version", "vLLM"), ("/get_model_info", "model_path", "SGLang")):
        try:
            status, body = get_json(root + path, key, timeout=5.0)
        except httpx.HTTPError:
            continue
        if status == 200 and isinstance(body, dict) and body.get(key_name):
            info["version"] = f"{kind} {body[key_name]}" if kind == "vLLM" else f"SGLang serving {body[key_name]}"
            break
    return info


def _infos(ctx) -> list[dict]:
    g = ctx.cfg.generate
    try:
        key = _api_key(ctx.cfg)
    except UsageError:
        key = None
    return [server_info(u, key, g.model) for u in g.servers]


def servers(ctx) -> list[CheckResult]:
    """Every server is reachable and serves ``generate.model``; its version is recorded."""
    g = ctx.cfg.generate
    results = []
    for info in _infos(ctx):
        name = f"server {info['url']}"
        if info["error"]:
            results.append(fail(name, info["error"], info["remedy"]))
            continue
        ids = [m.get("id") for m in info["models"]]
        if g.model not in ids:
            by_root = [m.get("id") for m in info["models"] if m.get("root") == g.model]
            results.append(
                fail(
                    name,
                    f"does not serve '{g.model}'; it serves: {', '.join(map(str, ids)) or 'nothing'}",
                    f"set generate.model to {by_root[0]!r} (served from that path)"
                    if by_root
                    else "set generate.model to one of the served ids, or start the server with that model "
                    "(vLLM: --served-model-name)",
                )
            )
            continue
        length = f"max_model_len {info['max_model_len']}" if info["max_model_len"] else "max_model_len not reported"
        results.append(ok(name, f"serves {g.model} ({length}); {info['version'] or 'version unknown'}"))
    return results


def health(ctx) -> list[CheckResult]:
    """The engine behind each server is alive: vLLM's ``/health`` turns 503 once its engine died (the API server
    itself keeps answering ``/v1/models``); SGLang's ``/health_generate`` runs a one-token generation."""
    results = []
    for info in _infos(ctx):
        name = f"health {info['url']}"
        if info["error"]:
            results.append(skip(name, "unreachable (see the server check)"))
            continue
        root = info["url"][: -len("/v1")] if info["url"].endswith("/v1") else info["url"]
        sglang = (info["version"] or "").startswith("SGLang")
        path = "/health_generate" if sglang else "/health"
        try:
            status, body = get_json(root + path, None, timeout=60.0 if sglang else 10.0)
        except httpx.HTTPError as err:
            results.append(
                fail(
                    name,
                    f"{root}{path} did not answer ({type(err).__name__}: {err})",
                    "the engine may be hung: check the server's log and restart it",
                )
            )
            continue
        if status == 200:
            results.append(ok(name, f"{path} answers 200" + (" (a one-token generation ran)" if sglang else "")))
        elif status == 404:
            results.append(
                skip(name, f"{root} has no {path} endpoint (not vLLM or SGLang); the smoke request tests it")
            )
        else:
            results.append(
                fail(
                    name,
                    f"{root}{path} answers HTTP {status}: the server's engine is dead or unhealthy ({str(body)[:120]})",
                    "restart the server (its log says why the engine died)",
                )
            )
    return results


def context_length(ctx) -> CheckResult:
    """The longest planned prompt plus max_tokens fits every server's max_model_len."""
    g = ctx.cfg.generate
    limits = [(i["max_model_len"], i["url"]) for i in _infos(ctx) if not i["error"] and i["max_model_len"]]
    if not limits:
        return skip("context length", "no server reported max_model_len")
    limit, url = min(limits)
    try:
        lengths, how, _ = prompt_tokens(ctx)
    except EaglekitError:
        return skip("context length", "the prompts do not load (see the prompts checks)")
    if not lengths:
        return skip("context length", "no prompts")
    longest, rid = lengths[0]
    over = [x for x in lengths if x[0] + g.max_tokens > limit]
    if over:
        return fail(
            "context length",
            f"prompt '{rid}' has {longest} tokens ({how}); with max_tokens {g.max_tokens} it needs "
            f"{longest + g.max_tokens} > max_model_len {limit} of {url}"
            + (
                f" ({len(over)}{'+' if len(over) == len(lengths) else ''} prompts are too long)"
                if len(over) > 1
                else ""
            ),
            "lower generate.max_tokens, start the server with a larger --max-model-len, or drop the longest prompts",
        )
    return ok(
        "context length", f"longest prompt {longest} tokens ({how}) + max_tokens {g.max_tokens} ≤ max_model_len {limit}"
    )


def judge_record(record: dict, seen: list[str], mode: str) -> tuple[list[str], list[str]]:
    """(failures, warnings) of one response record, as the smoke request judges it."""
    fails, warns = [], []
    length = record["finish_reason"] == "length"
    if mode == "required" and not record["reasoning"]:
        fails.append("no reasoning: " + explain_missing_reasoning(Counter(seen), 1, int(length)))
    if length:
        warns.append(
            "the reply stopped at max_tokens (finish_reason=length): raise generate.max_tokens "
            "unless the target's replies are meant to be cut"
        )
    elif record["finish_reason"] != "stop":
        warns.append(f"finish_reason is {record['finish_reason']!r}")
    if not record["content"] and not length:
        fails.append("the reply has no answer (empty content)")
    if has_think_tags(record["content"]):
        fails.append(
            f"think tags left in the answer after extraction: {record['content'][:80]!r} (the server's "
            "reasoning parser does not match the template's tags)"
        )
    if not isinstance(record["prompt_tokens"], int) or not isinstance(record["completion_tokens"], int):
        warns.append("the server sends no token counts (usage)")
    return fails, warns


def render_check(ctx, record: dict) -> str | None:
    """Why the record would not train well, rendered with the target's template; None when it renders right."""
    tokenizer = local_target_tokenizer(ctx.cfg)
    if tokenizer is None or not record["reasoning"] or not record["content"]:
        return None
    kwargs = ctx.cfg.generate.extra_body.get("chat_template_kwargs") or {}
    try:
        sample = render_sample(tokenizer, record["messages"], record["reasoning"], record["content"], kwargs)
    except EaglekitError as err:
        return f"the record does not render with the target's chat template: {err.message}"
    if template_has_think_tags(tokenizer) and "</think>" not in template_text(tokenizer):
        return None  # other tag names (e.g. <seed:think>): render_sample checked that the reasoning is kept
    reply = tokenizer.decode(sample.input_ids[sample.prompt_tokens :], skip_special_tokens=False)
    reasoning, _, found = split_inline_think(reply)
    if not found or reasoning.split() != record["reasoning"].split():
        return f"rendered for training, the reasoning is not inside the think tags: {reply[:160]!r}"
    return None


def served_template(ctx, root: str, key: str | None, messages: list[dict], data: dict) -> tuple[str | None, str]:
    """(how the server's rendering of the prompt differs from the local one, or None; what was compared). The
    server's own ids — the response's ``prompt_token_ids``, else its /tokenize — show the first differing tokens
    (also of renderings of equal length); a server with neither is judged by its ``usage.prompt_tokens``."""
    served = ServedPrompts(ctx.cfg)
    local = served.local_ids(messages)
    if local is None:
        return None, "prompt tokens not compared (no local tokenizer of the target)"
    ids = response_prompt_ids(data)
    if ids is None:
        ids = served_prompt_ids(root, key, ctx.cfg.generate.model, messages, served.kwargs)
    if ids is None and not isinstance((data.get("usage") or {}).get("prompt_tokens"), int):
        return None, "prompt tokens not compared (the server reports none)"
    problem = served.mismatch(local, data, ids)
    how = "token ids" if ids is not None else "token count"
    return problem, f"the prompt's {len(local)} tokens as rendered here" + (
        "" if problem else f", the server's {how} the same"
    )


def smoke(ctx) -> list[CheckResult]:
    """One real request per server through the run's own code path, and its record judged whole."""
    g = ctx.cfg.generate
    infos = [i for i in _infos(ctx) if not i["error"] and any(m.get("id") == g.model for m in i["models"])]
    if not infos:
        return [skip("smoke request", "no server to ask (see the server checks)")]
    try:
        key = _api_key(ctx.cfg)
    except UsageError:
        return [skip("smoke request", "no API key (see the API key check)")]
    try:
        prompt = run_prompts(ctx.cfg).records[0]
        mode, _ = target_reasoning_mode(ctx.cfg)
    except (EaglekitError, IndexError):
        return [skip("smoke request", "no prompt to send or no reasoning mode (see the checks above)")]

    async def ask(url: str):
        one = g.model_copy(update={"servers": [url], "concurrency": 1, "max_retries": min(g.max_retries, 1)})
        async with ChatClient(one, key) as client:
            return await client.chat(prompt.messages)

    results = []
    for info in infos:
        name = f"smoke request {info['url']}"
        try:
            reply = asyncio.run(ask(info["url"]))
        except RequestFailed as err:
            results.append(
                fail(
                    name,
                    f"prompt '{prompt.id}' failed after {err.attempts} attempts: {err.reason}",
                    "fix what the server says; `eaglekit preflight CONFIG` tries again",
                )
            )
            continue
        choice = reply.data["choices"][0]
        usage = reply.data.get("usage") or {}
        record, seen = make_record(
            prompt.id,
            prompt.messages,
            choice["message"],
            choice.get("finish_reason"),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            reply.data.get("model") or g.model,
            reply.server,
            choice.get("token_ids"),
        )
        fails, warns = judge_record(record, seen, mode)
        if not fails:
            problem = render_check(ctx, record)
            fails += [problem] if problem else []
        root = info["url"][: -len("/v1")] if info["url"].endswith("/v1") else info["url"]
        template, compared = served_template(ctx, root, key, prompt.messages, reply.data)
        detail = (
            f"reasoning from `{record['reasoning_source']}` ({len(record['reasoning'])} chars), answer "
            f"{len(record['content'])} chars, finish_reason {record['finish_reason']}, "
            f"{record['completion_tokens']} tokens; {compared}; fields sent: {', '.join(seen)}"
        )
        if template:
            problems = [f"prompt '{prompt.id}': {template}", *fails]
            results.append(fail(name, "; ".join(problems) + f" [{detail}]", TEMPLATE_REMEDY))
        elif fails:
            results.append(
                fail(
                    name,
                    "; ".join(fails) + f" [{detail}]",
                    "fix the server flags or generate.extra_body as said, then rerun the pre-flight",
                )
            )
        elif warns:
            results.append(warn(name, "; ".join(warns) + f" [{detail}]", "see the detail"))
        else:
            results.append(ok(name, detail))
    return results

"""Pre-flight of the vLLM feature servers, for every stage that asks them for hidden states: extract with
``extract.backend: vllm`` and train with ``extract.mode: stream``. The servers answer and serve the target with a
context for the longest sample, their storage folder is reachable here, and one real request per server proves the
layer ids, the final state's norm and the token alignment (the capture self-check, ``preflight/capture.py``)."""

from __future__ import annotations

import asyncio
import os
import shutil

from eaglekit.contract import StageContext
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.model.target import embedding_and_head, read_final_norm
from eaglekit.preflight import CheckResult, fail, ok, skip, will_be_produced
from eaglekit.preflight.capture import check_capture, parse_prompt_logprobs
from eaglekit.preflight.servers import server_info
from eaglekit.progress import console, human_bytes
from eaglekit.serving.client import RequestFailed
from eaglekit.serving.feature_transports import feature_transport, mooncake_fits
from eaglekit.serving.vllm_features import (
    FeatureClient,
    feature_api_key,
    server_bytes_per_token,
    server_dtype,
    server_layer_ids,
)
from eaglekit.training.stream import SPOOL_SLACK

SELF_CHECK_SAMPLES = 3  # the shortest prepared samples sent by the capture self-check
SELF_CHECK_LOGPROBS = 5  # prompt_logprobs asked per position: the prompt's token and the server's top 5


def _longest_sample(ctx: StageContext) -> int | None:
    path = ctx.run.stage_dir("prepare") / "tokens.safetensors"
    return int(TokenStore(path).lengths.max()) if path.exists() else None


def feature_servers(ctx: StageContext) -> list:
    """Every feature server answers, serves the model, and has a context for the longest sample plus one token."""
    source = ctx.resolved.feature_source  # declared for extract.backend vllm only, which requires extract.vllm
    v = source.servers
    try:
        key = feature_api_key(source)
    except EaglekitError as err:
        return [fail("feature servers", err.message, err.remedy or "")]
    model, longest = source.served_model, _longest_sample(ctx)
    results = []
    for url in v.servers:
        info = server_info(url, key, model)
        name = f"feature server {info['url']}"
        if info["error"]:
            results.append(
                fail(name, info["error"], info["remedy"] + "; the command to start it: `eaglekit serve-command CONFIG`")
            )
            continue
        if not any(m.get("id") == model for m in info["models"]):
            served = ", ".join(str(m.get("id")) for m in info["models"]) or "nothing"
            results.append(
                fail(
                    name,
                    f"does not serve '{model}'; it serves: {served}",
                    "set extract.vllm.model to the served id, or start the server for this target",
                )
            )
            continue
        limit = info["max_model_len"]
        if limit and longest and longest + 1 > limit:
            results.append(
                fail(
                    name,
                    f"max_model_len {limit} < the longest prepared sample ({longest} tokens) + 1",
                    f"restart it with --max-model-len {longest + 1} (or more)",
                )
            )
            continue
        results.append(
            ok(name, f"serves {model} (max_model_len {limit or '?'}); {info['version'] or 'version unknown'}")
        )
    return results


def feature_storage(ctx: StageContext):
    """The servers' shared_storage_path is a folder here that eaglekit can read and clean up."""
    assert ctx.cfg.extract.vllm is not None, "declared for extract.backend vllm only"
    if ctx.cfg.extract.through_mooncake:
        return skip("feature storage", "not read: the hidden states travel through Mooncake (extract.stream.transport)")
    path = ctx.cfg.extract.vllm.storage_path
    assert path is not None, "parse_config requires extract.vllm.storage_path for the file transport"
    if not os.path.isdir(path):
        return fail(
            "feature storage",
            f"extract.vllm.storage_path {path} is not a folder here",
            "create it on storage both this machine and the servers reach (the same folder the servers' "
            "shared_storage_path names), and set it to this machine's path of it",
        )
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return fail(
            "feature storage",
            f"{path} is not readable and writable here",
            "eaglekit reads each request's file there and deletes it: fix the permissions",
        )
    return ok("feature storage", f"{path} (each request's file is deleted once its rows are in a shard)")


def feature_smoke(ctx: StageContext) -> list:
    """One real request per server through the run's own code path, then the server's own next token is
    checked against the captured final state through the target's norm and lm_head — which proves the layer
    ids, the pre-norm final state and the token alignment in one go. The same requests carry the capture
    self-check (``eaglekit.preflight.capture``): every next-token log-prob of a few samples rebuilt from the
    rows eaglekit would write, against the server's ``prompt_logprobs``."""
    cfg, v = ctx.cfg, ctx.resolved.feature_source.servers  # declared for extract.backend vllm only
    path = ctx.run.stage_dir("prepare") / "tokens.safetensors"
    pending = will_be_produced(ctx, "feature smoke request", "prepare")
    if pending or not path.exists():  # (not pending and missing: the upstream check fails and says why)
        return [pending or skip("feature smoke request", "no prepared tokens yet")]
    store = TokenStore(path)
    if len(store) == 0:
        return [skip("feature smoke request", "no prepared samples")]
    shortest = store.lengths.argsort(stable=True)[:SELF_CHECK_SAMPLES].tolist()
    try:
        hf, aux = ctx.resolved.target_and_aux
        layer_ids = server_layer_ids(aux, hf.num_hidden_layers)
        norm = read_final_norm(cfg.target)
        _, head = embedding_and_head(cfg.target.model, cfg.target.trust_remote_code)
    except EaglekitError as err:  # the target's norm or lm_head cannot be read by name
        return [fail("feature smoke request", err.message, err.remedy or "check target.model")]
    results = []
    for url in v.servers:
        results += smoke_server(ctx, url, store, shortest, layer_ids, hf.hidden_size, norm, head)
    return results


def smoke_server(ctx: StageContext, url: str, store, shortest: list[int], layer_ids, hidden, norm, head) -> list:
    """The smoke request to one server: the next-token check on the shortest sample, then the capture self-check
    on the ``shortest`` few (or one failure, when a request fails)."""
    source = ctx.resolved.feature_source  # declared for extract.backend vllm only
    v = source.servers
    name = f"feature smoke request {url}"
    one = v.model_copy(update={"servers": [url], "concurrency": 1, "max_retries": min(v.max_retries, 1)})

    async def ask():
        async with FeatureClient(
            one,
            feature_api_key(source),
            source.served_model,
            layer_ids,
            hidden,
            norm,
            f"eksmoke{os.getpid()}",
            self_check=SELF_CHECK_LOGPROBS,
            transport=feature_transport(source),
        ) as client:
            return [await client.capture(j, store[j][1].tolist()) for j in shortest]

    try:
        caps = asyncio.run(ask())
    except RequestFailed as err:
        return [
            fail(
                name,
                f"sample {store.ids[shortest[0]]!r} failed after {err.attempts} attempts: {err.reason}",
                "fix what the server says; `eaglekit preflight CONFIG --stage extract` tries again",
            )
        ]
    except EaglekitError as err:
        return [fail(name, err.message, err.remedy or "see the message")]
    next_token = next_token_check(name, len(store[shortest[0]][1].tolist()), caps[0], head)
    checked = [
        check_capture(
            f"capture self-check {url}",
            c.states,
            layer_ids,
            c.last_hidden,
            norm,
            head,
            parse_prompt_logprobs(c.prompt_logprobs),
        )
        for c in caps
        if c.states is not None
    ]
    return [next_token, next((r for r in checked if r.status == "fail"), checked[-1])]


def next_token_check(name: str, tokens: int, cap, head) -> CheckResult:
    """The server's next token against ours: its captured final state through the target's norm and lm_head."""
    logits = cap.last_hidden[-1].float() @ head.float().T
    top = logits.topk(min(5, logits.numel())).indices.tolist()
    detail = (
        f"{tokens} tokens, states {list(cap.aux.shape)} + {list(cap.last_hidden.shape)} "
        f"({cap.aux.dtype}); the server's next token {cap.generated}, ours {top[0]}"
    )
    if cap.generated is None:
        return ok(name, detail + " (the server returned no token ids; next-token check skipped)")
    if cap.generated == top[0]:
        return ok(name, detail)
    if cap.generated in top:
        return CheckResult(
            name,
            "warn",
            detail + ": within our top 5 (a near-tie, bf16 numerics)",
            "fine for training when it happens rarely",
        )
    return fail(
        name,
        detail + ": the captured final state does not predict the server's token",
        "the server's layer ids or model differ from this config, or the target's final norm "
        "is not a plain RMSNorm: restart it with `eaglekit serve-command CONFIG`",
    )


def stream_capture_check(cfg):
    """The capture self-check of a streamed run, on its first requests: ``check(captures, layer_ids, norm)`` raises
    when the rows eaglekit makes do not rebuild the server's own prompt log-probs (the same check as extract's
    smoke request)."""
    _, head = embedding_and_head(cfg.target.model, cfg.target.trust_remote_code)

    def check(captures: list, layer_ids: list[int], norm) -> None:
        results = [
            check_capture(
                f"capture self-check {c.server}",
                c.states,
                layer_ids,
                c.last_hidden,
                norm,
                head,
                parse_prompt_logprobs(c.prompt_logprobs),
            )
            for c in captures
            if c.states is not None
        ]
        bad = next((r for r in results if r.status == "fail"), None)
        if bad is not None:
            raise EaglekitError(f"stream: {bad.name}: {bad.detail}", bad.remedy)
        if results:
            console.print(
                f"train: stream: {results[-1].name} on the first {len(results)} requests: {results[-1].detail}"
            )

    return check


def spool_room(ctx: StageContext):
    """A streamed run: the storage folder has room for extract.stream.spool_gb, and the spool for the longest
    sample's file (a request larger than the spool could never be sent)."""
    name = "feature spool"
    source = ctx.resolved.feature_source  # declared for extract.mode stream only, which requires extract.vllm
    spool, path = source.spool_bytes, source.servers.storage_path
    if source.through_mooncake:
        try:
            mooncake_fits(source)
        except EaglekitError as err:
            return fail(name, err.message, err.remedy or "")
        segments = len(source.servers.servers) * source.stream.mooncake.global_segment_size
        detail = f"{human_bytes(spool)} of the servers' Mooncake segments ({human_bytes(segments)})"
    elif path is None or not os.path.isdir(path):  # (None: parse_config refuses it for the file transport)
        return skip(name, "the feature storage check says why the folder is missing")
    else:
        free = shutil.disk_usage(path).free
        if free < spool:
            return fail(
                name,
                f"extract.stream.spool_gb is {human_bytes(spool)} but {path} has {human_bytes(free)} free",
                f"free space there or lower extract.stream.spool_gb to {free / 1e9 * 0.9:.1f}",
            )
        detail = f"{human_bytes(spool)} of {human_bytes(free)} free in {path}"
    longest = _longest_sample(ctx)
    if longest:
        hf, aux = ctx.resolved.target_and_aux
        states = len(server_layer_ids(aux, hf.num_hidden_layers))
        dtype, kind = server_dtype(hf), str(server_dtype(hf)).removeprefix("torch.")
        # what the stream reserves for the request (training/stream.py): the states in the servers' dtype, the header
        need = SPOOL_SLACK + longest * server_bytes_per_token(states, hf.hidden_size, dtype)
        if need > spool:
            return fail(
                name,
                f"the longest prepared sample ({longest:,} tokens) makes a file of {human_bytes(need)} ({kind}), more "
                f"than the spool ({human_bytes(spool)})",
                f"raise extract.stream.spool_gb to at least {need / 1e9 * 1.1:.3g}",
            )
        detail += (
            f"; the longest sample's file is {human_bytes(need)} ({kind} states): {spool / need:,.0f} such in flight"
        )
    return ok(name, detail)

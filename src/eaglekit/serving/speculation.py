"""What a serving engine reports about its speculative decoding, read over HTTP: the engine's own counters.

``eaglekit verify`` sends the evaluation prompts as token ids at temperature 0, one request at a time, and
reads what the engine counted. The names were read from the engines' source:

* vLLM (``v1/spec_decode/metrics.py``, ``v1/core/sched/scheduler.py``): Prometheus counters on ``/metrics``,
  ``vllm:spec_decode_num_drafts_total`` (verify passes that carried drafts),
  ``vllm:spec_decode_num_accepted_tokens_total`` and ``vllm:spec_decode_num_accepted_tokens_per_pos_total``
  (label ``position``, 0-based; one series per position up to K-1). Mean acceptance length = 1 + accepted /
  drafts. Started with ``--per-request-spec-decode-metrics detailed`` a response also carries
  ``metrics.speculative_decoding.per_step_accepted``: the accepted count of every verify pass, in order.
  Prompts go to ``/v1/completions`` as token ids (``prompt: [ids]``), so the engine sees exactly the ids
  eaglekit decodes offline; ``return_token_ids`` gives the output ids.
* SGLang (``srt/managers/tokenizer_manager.py``, ``_calculate_spec_decoding_metrics``): ``/generate`` with
  ``input_ids``; ``meta_info.spec_verify_ct`` (verify passes), ``spec_accept_length`` = completion_tokens /
  spec_verify_ct (the first token, from the prefill, included), and an acceptance histogram indexed by the
  number of drafts accepted in a pass (``spec_accept_histogram``, renamed ``spec_correct_drafts_histogram``).
  ``/get_server_info`` holds the server's arguments (``speculative_num_steps``, ``speculative_eagle_topk``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

from eaglekit.errors import EaglekitError
from eaglekit.serving.engine import metric_sum, parse_prometheus

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"  # drafts x tokens drafted in each (K, unless scheduled)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:request_prompt_tokens"  # a histogram: _sum and _count over finished requests
GENERATION_TOKENS = "vllm:request_generation_tokens"
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class Served:
    """One prompt as the engine answered it."""

    tokens: list[int]  # output token ids (the stop token kept, as eaglekit keeps it)
    accepted_per_round: list[int] | None  # per verify pass, when the engine reports it per request
    verify_passes: int | None = None  # SGLang: spec_verify_ct
    histogram: list[int] | None = None  # SGLang: passes by number of drafts accepted


@dataclass
class Counters:
    """The engine's speculation counters over a batch of requests (vLLM's definitions)."""

    drafts: int = 0  # verify passes that carried drafts
    accepted: list[int] = field(default_factory=list)  # per draft position
    emitted: int | None = None  # SGLang: completion tokens (first token included)
    verify_passes: int | None = None  # SGLang: spec_verify_ct
    draft_tokens: int | None = None  # vLLM: tokens drafted over all drafts (drafts x K unless a schedule cut K)

    @property
    def tau(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts."""
        return 1 + sum(self.accepted) / self.drafts if self.drafts else 1.0

    def rates(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted]

    def __sub__(self, before: Counters) -> Counters:
        """What was counted since ``before`` (vLLM's cumulative counters; positions registered since count from 0)."""
        width = max(len(self.accepted), len(before.accepted))
        pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731
        tokens = self.draft_tokens - (before.draft_tokens or 0) if self.draft_tokens is not None else None
        return Counters(
            self.drafts - before.drafts,
            [a - b for a, b in zip(pad(self.accepted), pad(before.accepted), strict=False)],
            draft_tokens=tokens,
        )


def request_spread(per_request: list[tuple[int, list[int]]]) -> dict | None:
    """How much τ and each position's acceptance vary between requests, for a band on a pooled figure.

    ``per_request``: each request's drafts (verify passes with drafts) and accepted tokens per position. A pooled
    rate r = Σa / Σd over R requests has the standard error s / √R with s² = Σ (a_j − r·d_j)² / ((R − 1)·d̄²) (the
    ratio estimator's): the requests, not the drafts, are the independent units, since the drafts of one request
    share its prompt and accept together. ``spread`` is s per draft position, ``tau_spread`` s of the accepted
    tokens per draft (τ − 1)."""
    rows = [(d, a) for d, a in per_request if d > 0]
    if len(rows) < 2:
        return None
    k = max(len(a) for _, a in rows)
    rows = [(d, a + [0] * (k - len(a))) for d, a in rows]
    drafts = sum(d for d, _ in rows)
    mean = drafts / len(rows)

    def spread(values: list[int]) -> float:
        rate = sum(values) / drafts
        residual = sum((v - rate * d) ** 2 for v, (d, _) in zip(values, rows, strict=True))
        return (residual / (len(rows) - 1)) ** 0.5 / mean

    return {
        "requests": len(rows),
        "drafts_per_request": round(mean, 3),
        "tau_spread": round(spread([sum(a) for _, a in rows]), 5),
        "spread": [round(spread([a[i] for _, a in rows]), 5) for i in range(k)],
    }


@dataclass
class Snapshot:
    """vLLM's cumulative counters at one moment: speculation, and the finished requests with their token counts."""

    counters: Counters
    requests: float  # finished requests
    prompt_tokens: float = 0.0  # summed over finished requests (the histogram's _sum)
    generation_tokens: float = 0.0


def root_of(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def detect(url: str, timeout: float = 10.0) -> str:
    """'sglang' or 'vllm' for the server at ``url`` (SGLang answers /get_model_info, vLLM /version)."""
    root = root_of(url)
    try:
        if httpx.get(f"{root}/get_model_info", timeout=timeout).status_code == 200:
            return "sglang"
        if httpx.get(f"{root}/version", timeout=timeout).status_code == 200:
            return "vllm"
    except httpx.HTTPError as err:
        raise EaglekitError(
            f"verify.server {url} does not answer ({type(err).__name__}: {err})",
            "start the server with the command `eaglekit export` printed, or fix verify.server",
        ) from None
    raise EaglekitError(
        f"verify.server {url} answers neither /get_model_info (SGLang) nor /version (vLLM)",
        "point verify.server at a vLLM or SGLang server",
    )


# ----------------------------------------------------------------------------------------------- vLLM


class VllmClient:
    def __init__(self, url: str, timeout: float):
        self.root = root_of(url)
        self.timeout = timeout
        models = self._get("/v1/models").json().get("data") or []
        if not models:
            raise EaglekitError(f"{self.root}/v1/models lists no model", "check the server's log")
        self.model = models[0]["id"]

    def _get(self, path: str) -> httpx.Response:
        response = httpx.get(self.root + path, timeout=self.timeout)
        response.raise_for_status()
        return response

    def counters(self) -> tuple[Counters, float]:
        """The cumulative counters now, and the number of requests finished so far."""
        snapshot = self.snapshot()
        return snapshot.counters, snapshot.requests

    def snapshot(self) -> Snapshot:
        """Everything /metrics counts that verify and watch compare, read at once."""
        metrics = parse_prometheus(self._get("/metrics").text)
        positions = {
            int(m.group(1))
            for key in metrics
            if key.startswith(PER_POSITION + "{")
            for m in [_POSITION.search(key)]
            if m
        }
        accepted = [int(metric_sum(metrics, PER_POSITION, position=str(p))) for p in range(len(positions))]
        tokens = int(metric_sum(metrics, DRAFT_TOKENS)) if any(k.startswith(DRAFT_TOKENS) for k in metrics) else None
        return Snapshot(
            Counters(int(metric_sum(metrics, DRAFTS)), accepted, draft_tokens=tokens),
            metric_sum(metrics, REQUESTS),
            metric_sum(metrics, PROMPT_TOKENS + "_sum"),
            metric_sum(metrics, GENERATION_TOKENS + "_sum"),
        )

    def num_speculative_tokens(self) -> int:
        """K, read from the per-position series the engine registers (one per draft position)."""
        return len(self.counters()[0].accepted)

    def greedy(self, prompt_ids: list[int], max_tokens: int, stop_ids: list[int]) -> Served:
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        response = httpx.post(f"{self.root}/v1/completions", json=body, timeout=self.timeout)
        if response.status_code != 200:
            raise EaglekitError(
                f"{self.root}/v1/completions answered {response.status_code}: {response.text[:500]}",
                "read the server's log",
            )
        data = response.json()
        choice = data["choices"][0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise EaglekitError(
                f"{self.root} returned no token_ids (return_token_ids needs vLLM >= 0.10.2)",
                "verify against a newer vLLM",
            )
        spec = (data.get("metrics") or {}).get("speculative_decoding") or {}
        return Served(list(tokens), spec.get("per_step_accepted"))


def vllm_batch(
    client: VllmClient, prompts: list[tuple[str, list[int]]], max_tokens: int, stop_ids: list[int], progress=None
) -> tuple[dict[str, Served], Counters]:
    """Send each prompt once, one at a time; the counters are the difference across the batch.

    Another client's requests in between would be counted too: refused (the request count must match).
    """
    before, requests_before = client.counters()
    served = {}
    for pid, ids in prompts:
        served[pid] = client.greedy(ids, max_tokens, stop_ids)
        if progress:
            progress()
    after, requests_after = client.counters()
    if requests_after - requests_before != len(prompts):
        raise EaglekitError(
            f"{client.root} finished {requests_after - requests_before:.0f} requests while verify sent "
            f"{len(prompts)}: other traffic is mixed into its counters",
            "run verify against a server nobody else uses while it runs",
        )
    return served, after - before


# --------------------------------------------------------------------------------------------- SGLang


class SglangClient:
    def __init__(self, url: str, timeout: float):
        self.root = root_of(url)
        self.timeout = timeout
        info = httpx.get(f"{self.root}/get_server_info", timeout=timeout)
        info.raise_for_status()
        self.info = info.json()

    def num_speculative_tokens(self) -> int:
        """K of a chain (topk 1); a tree's acceptance is not comparable with chain drafting."""
        algorithm = self.info.get("speculative_algorithm")
        if not algorithm or "EAGLE" not in str(algorithm).upper():
            raise EaglekitError(
                f"the SGLang server at {self.root} runs no EAGLE speculation (speculative_algorithm {algorithm})",
                "start it with the command `eaglekit export` printed (--speculative-algorithm EAGLE3)",
            )
        topk = int(self.info.get("speculative_eagle_topk") or 1)
        if topk != 1:
            raise EaglekitError(
                f"the SGLang server drafts a tree (speculative_eagle_topk {topk}): its acceptance "
                "cannot be compared with chain drafting",
                "verify with --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1",
            )
        return int(self.info["speculative_num_steps"])

    @property
    def draft_model_path(self) -> str | None:
        return self.info.get("speculative_draft_model_path")

    def greedy(self, prompt_ids: list[int], max_tokens: int, stop_ids: list[int]) -> Served:
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_tokens,
                "stop_token_ids": stop_ids,
                "skip_special_tokens": False,
            },
        }
        response = httpx.post(f"{self.root}/generate", json=body, timeout=self.timeout)
        if response.status_code != 200:
            raise EaglekitError(
                f"{self.root}/generate answered {response.status_code}: {response.text[:500]}", "read the server's log"
            )
        data = response.json()
        meta = data.get("meta_info") or {}
        if "output_ids" not in data:
            raise EaglekitError(f"{self.root}/generate returned no output_ids", "verify against a newer SGLang")
        histogram = meta.get("spec_accept_histogram") or meta.get("spec_correct_drafts_histogram")
        return Served(
            list(data["output_ids"]), None, int(meta.get("spec_verify_ct") or 0), list(histogram) if histogram else None
        )


def sglang_batch(
    client: SglangClient,
    prompts: list[tuple[str, list[int]]],
    max_tokens: int,
    stop_ids: list[int],
    k: int,
    progress=None,
) -> tuple[dict[str, Served], Counters]:
    """Per-request meta_info summed over the batch (SGLang has no drafts-per-position counter of its own: the
    histogram of accepted drafts per pass gives it: position i accepted in every pass that accepted more than i)."""
    served: dict[str, Served] = {}
    counters = Counters(0, [0] * k)
    emitted = verify_passes = 0
    for pid, ids in prompts:
        s = client.greedy(ids, max_tokens, stop_ids)
        served[pid] = s
        emitted += len(s.tokens)
        verify_passes += s.verify_passes or 0
        if s.histogram:
            counters.drafts += sum(s.histogram)
            for j, passes in enumerate(s.histogram):
                for i in range(min(j, k)):
                    counters.accepted[i] += passes
        if progress:
            progress()
    counters.emitted, counters.verify_passes = emitted, verify_passes
    return served, counters

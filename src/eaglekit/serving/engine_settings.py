"""The engine's speculative settings that change served τ without changing the drafter: read from the command
eaglekit started, from vLLM's log, or from a running server, and what each one does to a comparison with
eaglekit's offline figures.

eaglekit's offline decoding (evaluate, verify) drafts each token by the drafter's argmax, K drafts in every
verify pass, and accepts a draft when the target's own rejection sampling would. vLLM 0.32
(``vllm/config/speculative.py``, ``SpeculativeConfig``) can serve the same drafter otherwise:

* ``rejection_sample_method``: ``standard`` (the target decides), ``synthetic`` (drafts accepted at a configured
  rate, ``synthetic_acceptance_rates`` / ``_length``: served τ is the setting's, not the drafter's) or ``block``
  (block verification, Sun et al.: the drafts judged together; at T=0 the same as standard).
* ``draft_sample_method``: ``greedy`` or ``probabilistic`` (drafts sampled from the drafter's distribution at the
  request's temperature; in a batch where every request is greedy vLLM still takes the argmax,
  ``v1/spec_decode/llm_base_proposer.py: _sample_from_logits``), so it changes τ at T > 0 only.
* ``num_speculative_tokens_per_batch_size``: ``[(first, last, K), ...]`` by batch size
  (``v1/core/sched/scheduler.py``): a busy engine drafts fewer tokens than ``num_speculative_tokens``.
* ``enable_adaptive_verification`` (DSpark): the verify budget sized per request from the drafter's confidence.
* the drafter's own ``attention_backend`` / ``kv_cache_dtype`` (otherwise the target's, ``_DRAFT_VLLM_CONFIG_
  OVERRIDES``): another kernel or an fp8 draft cache moves its numerics.
* ``use_heterogeneous_vocab`` (``draft_model`` only): the drafter's logits mapped onto the target's vocabulary.

Where vLLM says what it was started with: its log's ``non-default args: {...}`` line (the API server's parsed
arguments, ``entrypoints/serve/utils/api_utils.py: log_non_default_args``) and the engine core's ``speculative_
config=SpeculativeConfig(method=..., model=..., num_spec_tokens=...)``; a running server's whole config only on
``/server_info?config_format=json``, which vLLM registers with ``VLLM_SERVER_DEV_MODE=1`` alone. ``/metrics``
always says what was served: one ``…_per_pos`` series per draft position (K), and
``vllm:spec_decode_num_draft_tokens_total`` / ``…_num_drafts_total``, the drafts per verify pass (below K under
a batch-size schedule or adaptive verification).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

FLAG = "--speculative-config"
# vLLM 0.32's defaults: what eaglekit's offline figures assume of the engine
DEFAULTS: dict[str, Any] = {
    "rejection_sample_method": "standard",
    "draft_sample_method": "greedy",
    "num_speculative_tokens_per_batch_size": None,
    "enable_adaptive_verification": False,
    "attention_backend": None,
    "kv_cache_dtype": None,
    "use_heterogeneous_vocab": False,
}
RECORDED = ("method", "model", "num_speculative_tokens", *DEFAULTS, "synthetic_acceptance_rates")
DEFAULT_SOURCE = "vLLM default"
# A drafted-per-pass mean this far below K is a schedule at work, not the last pass of a request cut short
# (which vLLM still counts as a draft of K tokens).
SHORT_DRAFTS = 0.02

_NON_DEFAULT = re.compile(r"non-default args: ")
_CORE_REPR = re.compile(
    r"speculative_config=SpeculativeConfig\(method='?(?P<method>[^',)]*)'?, model='?(?P<model>[^',)]*)'?, "
    r"num_spec_tokens=(?P<k>\d+)\)"
)


def from_args(args: list[str]) -> dict[str, Any] | None:
    """The speculative config in a vLLM command line: ``--speculative-config JSON`` (or ``=JSON``), and the
    dotted form vLLM also takes (``--speculative-config.num_speculative_tokens 3``)."""
    out: dict[str, Any] = {}
    found = False
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag == FLAG:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            with contextlib.suppress(ValueError):
                parsed = json.loads(value)
                if isinstance(parsed, dict):
                    out.update(parsed)
                    found = True
        elif flag.startswith(FLAG + "."):
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                out[flag[len(FLAG) + 1 :].replace("-", "_")] = json.loads(value)
            except ValueError:
                out[flag[len(FLAG) + 1 :].replace("-", "_")] = value
            found = True
    return out if found else None


def from_log(text: str) -> dict[str, Any] | None:
    """The speculative config vLLM's log says it started with: the last ``non-default args`` line's
    ``speculative_config`` (every key given on the command line), completed by the engine core's
    ``SpeculativeConfig(...)`` repr (method, model and K as the engine resolved them: a speculators folder served
    as the model names its method and drafter only there)."""
    given: dict[str, Any] | None = None
    for line in reversed(text.splitlines()):
        m = _NON_DEFAULT.search(line)
        if m:
            given = _dict_after(line, line.find("'speculative_config':", m.end()))
            break
    resolved: dict[str, Any] | None = None
    for line in reversed(text.splitlines()):
        core = _CORE_REPR.search(line)
        if core:
            resolved = {
                "method": core["method"] if core["method"] != "None" else None,
                "model": core["model"] if core["model"] != "None" else None,
                "num_speculative_tokens": int(core["k"]),
            }
            break
    if given is None and resolved is None:
        return None
    return (resolved or {}) | (given or {})


def _dict_after(line: str, start: int) -> dict[str, Any] | None:
    """The Python dict literal that follows ``start`` in ``line`` (balanced braces), or None."""
    if start < 0:
        return None
    begin = line.find("{", start)
    depth = 0
    for end in range(begin, len(line)):
        depth += {"{": 1, "}": -1}.get(line[end], 0)
        if depth == 0 and begin >= 0:
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(line[begin : end + 1])
                return value if isinstance(value, dict) else None
            return None
    return None


def from_server(root: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """A running vLLM's speculative config from ``/server_info`` (answers only with VLLM_SERVER_DEV_MODE=1)."""
    try:
        response = httpx.get(f"{root}/server_info", params={"config_format": "json"}, timeout=timeout)
        if response.status_code != 200:
            return None
        spec = (response.json().get("vllm_config") or {}).get("speculative_config")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return spec if isinstance(spec, dict) else None


@dataclass
class EngineSettings:
    """The recorded settings, each with where it was read (``command``, ``log``, ``/server_info``, or vLLM's
    default where no source names it); ``sources`` lists what was read at all."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, *sources: tuple[str, dict[str, Any] | None]) -> EngineSettings:
        """Merged from ``(name, config)`` pairs, the first source that names a key winning."""
        out = cls()
        for name, config in sources:
            if config is None:
                continue
            out.sources.append(name)
            for key in RECORDED:
                if key in config and key not in out.values:
                    out.values[key], out.origin[key] = config[key], name
        if out.sources:  # a key no source named has vLLM's default
            for key, value in DEFAULTS.items():
                if key not in out.values:
                    out.values[key], out.origin[key] = value, DEFAULT_SOURCE
        return out

    def differing(self) -> dict[str, Any]:
        """The settings that are not what eaglekit's offline figures assume."""
        return {k: self.values[k] for k in DEFAULTS if k in self.values and self.values[k] != DEFAULTS[k]}

    def as_dict(self) -> dict:
        return {
            "sources": self.sources,
            "settings": {k: {"value": v, "source": self.origin[k]} for k, v in self.values.items()},
        }


def drafts_per_pass(draft_tokens: int | None, drafts: int) -> float | None:
    """The engine's mean drafts per verify pass (vLLM's num_draft_tokens / num_drafts)."""
    return draft_tokens / drafts if draft_tokens is not None and drafts else None


@dataclass
class Effect:
    """One setting that differs from eaglekit's assumptions, what it does, and whether it moves τ in the measurement
    at hand (a schedule that did not bite, or probabilistic drafts at T=0, is recorded and explains nothing)."""

    setting: str
    detail: str
    explains_gap: bool


def setting_effects(settings: dict[str, Any], k: int, per_pass: float | None, temperature: float) -> list[Effect]:
    """The effects of ``settings`` on requests at ``temperature`` drafted ``per_pass`` tokens per verify pass
    (the engine's counters; None where unknown) against K=``k``."""
    out = []
    method = settings.get("rejection_sample_method", "standard")
    if method == "synthetic":
        rates = settings.get("synthetic_acceptance_rates")
        out.append(
            Effect(
                "rejection_sample_method",
                "synthetic: the engine accepts drafts at a configured rate"
                + (f" ({rates})" if rates else "")
                + ", not by the target, so served τ measures the setting, not the drafter",
                True,
            )
        )
    elif method == "block":
        out.append(
            Effect(
                "rejection_sample_method",
                "block: the drafts are verified together (Sun et al.), which accepts more than token-by-token "
                "rejection at T > 0" + ("" if temperature > 0 else "; at T=0 both accept exactly the target's argmax"),
                temperature > 0,
            )
        )
    if settings.get("draft_sample_method") == "probabilistic":
        out.append(
            Effect(
                "draft_sample_method",
                "probabilistic: the drafter samples its drafts at the request's temperature where eaglekit takes "
                "its argmax" + ("" if temperature > 0 else "; at T=0 vLLM takes the argmax too (every request greedy)"),
                temperature > 0,
            )
        )
    schedule = settings.get("num_speculative_tokens_per_batch_size")
    adaptive = bool(settings.get("enable_adaptive_verification"))
    short = per_pass is not None and per_pass < k - SHORT_DRAFTS
    if short:
        cause = (
            f"num_speculative_tokens_per_batch_size {schedule}"
            if schedule
            else "enable_adaptive_verification"
            if adaptive
            else "a setting not in the engine's recorded config"
        )
        out.append(
            Effect(
                "drafts per verify pass",
                f"the engine drafted {per_pass:.2f} tokens per verify pass where K={k} was asked: {cause} served "
                "fewer drafts, and τ falls with them",
                True,
            )
        )
    elif schedule:
        out.append(
            Effect(
                "num_speculative_tokens_per_batch_size",
                f"{schedule}: K by batch size; these requests were drafted at K={k}"
                + ("" if per_pass is not None else " (the engine's draft-token counter was not read)"),
                False,
            )
        )
    elif adaptive:
        out.append(Effect("enable_adaptive_verification", "the verify budget sized per request", False))
    if settings.get("kv_cache_dtype"):
        dtype = str(settings["kv_cache_dtype"])
        out.append(Effect("kv_cache_dtype", f"{dtype}: the drafter's own KV cache in {dtype}", dtype.startswith("fp8")))
    if settings.get("attention_backend"):
        out.append(
            Effect(
                "attention_backend",
                f"{settings['attention_backend']}: the drafter's own attention kernel (numerics of that kernel)",
                False,
            )
        )
    if settings.get("use_heterogeneous_vocab"):
        out.append(Effect("use_heterogeneous_vocab", "the drafter's logits mapped onto the target's vocabulary", True))
    return out

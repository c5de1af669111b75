"""Draft → verify decoding with a Hugging Face target, KV-cached on both sides, one sequence at a time.

This measures acceptance the way a serving engine would, without a server. Each round the proposer
drafts up to K tokens in a chain, the target scores the last emitted token plus the drafts in one
KV-cached pass, the longest acceptable prefix is kept and one more token comes from the target (the
bonus, or the resampled token at the first rejection); both KV caches are then cropped to the kept
tokens. With no proposer the same loop is plain decoding, which is the baseline for speed and, at
temperature 0, for losslessness (speculative output must equal it token for token).

Acceptance (Leviathan et al. 2023): greedy accepts a draft while it equals the target's argmax; sampling
accepts draft d with probability min(1, p(d)/q(d)) and on rejection samples norm(max(0, p − q)). A
proposer that returns no q (n-gram, and EAGLE drafting greedily as vLLM and SGLang do) is a point mass:
accept with probability p(d), resample from p without d.

Two ways to count. By default a round never drafts past ``max_new_tokens`` and acceptance counts only the
tokens kept. ``engine_accounting=True`` counts as vLLM's scheduler does (``v1/core/sched/scheduler.py``):
every round drafts K tokens however few are left ("we don't schedule partial draft tokens"), and
``num_accepted = len(sampled) - 1`` is counted before the stop token or the length limit cut the output.
The tokens emitted are the same either way; only the counters near the end of a sequence differ, and with
them τ by a few thousandths. ``eaglekit verify`` compares with an engine's counters, so it counts like one.

"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache


class Proposer(Protocol):
    """What the loop needs from a drafting method.

    ``aux_layer_ids``: HF hidden_states indices the proposer consumes (their concatenation is the
    ``aux`` argument below), or None when it needs no target states.
    """

    @property
    def aux_layer_ids(self) -> list[int] | None: ...

    def reset(self, ids: list[int], aux: torch.Tensor | None) -> None:
        """Start a sequence: ``ids`` = prompt + first token; ``aux`` [len(ids)-1, 3Ht] = target states of ids[:-1]."""

    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``k`` draft ids (target vocab) and their distributions q [n, V], or None for point masses."""

    def update(self, new_ids: list[int], aux: torch.Tensor | None) -> None:
        """The round emitted ``new_ids``; ``aux`` [len(new_ids), 3Ht] = target states of the token before each."""


@dataclass
class DecodeStats:
    rounds: int = 0  # target passes after the prefill (each emits >= 1 token)
    emitted: int = 0  # tokens those passes emitted, bonus tokens included
    new_tokens: int = 0  # all generated tokens (the prefill's first token included)
    seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)  # per draft position: rounds that drafted a token there
    accepted: list[int] = field(default_factory=list)  # per draft position: rounds whose draft there was accepted

    @property
    def tau(self) -> float:
        """Tokens per target verify pass (τ ≥ 1, ≤ K+1)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Share of drafts accepted at each chain position (vLLM's per-position rate: unconditional)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=False)]

    def __add__(self, other: DecodeStats) -> DecodeStats:
        width = max(len(self.drafted), len(other.drafted))
        pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731
        return DecodeStats(
            self.rounds + other.rounds,
            self.emitted + other.emitted,
            self.new_tokens + other.new_tokens,
            self.seconds + other.seconds,
            [a + b for a, b in zip(pad(self.drafted), pad(other.drafted), strict=False)],
            [a + b for a, b in zip(pad(self.accepted), pad(other.accepted), strict=False)],
        )


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats
    accepted_per_round: list[int] = field(default_factory=list)  # drafts accepted in each verify pass, in order
    # per verify pass that drafted: tokens in the context before its first draft (prompt + output so far)
    context_per_round: list[int] = field(default_factory=list)


# EAGLE-3 acceptance falls as the context grows (the drafter is trained on short sequences), so reports
# group verify passes by where their draft starts. Upper bounds in tokens; the last bucket is open.
CONTEXT_BUCKETS: tuple[tuple[str, int | None], ...] = (
    ("<1k", 1024),
    ("1-4k", 4096),
    ("4-16k", 16384),
    (">16k", None),
)


def context_bucket(position: int) -> str:
    """The CONTEXT_BUCKETS label of a draft that starts after ``position`` context tokens."""
    return next(label for label, bound in CONTEXT_BUCKETS if bound is None or position < bound)


def tau_by_context(generations: list[Generation]) -> dict[str, dict[str, float]]:
    """Per context bucket that has verify passes: their count and τ (1 + mean drafts accepted per pass)."""
    return tau_by_context_of([(gen.accepted_per_round, gen.context_per_round) for gen in generations])


def served_context_per_round(prompt_tokens: int, accepted_per_round: list[int]) -> list[int]:
    """Where each verify pass of an engine's request drafted from, as ``generate`` counts it: after the prompt and
    the prefill's token, each pass adds its accepted drafts and the target's own token. An engine reports only the
    accepted counts per request (vLLM's per-request metrics); every pass of a speculating request drafts."""
    contexts, position = [], prompt_tokens + 1
    for n_acc in accepted_per_round:
        contexts.append(position)
        position += n_acc + 1
    return contexts


def tau_by_context_of(requests: list[tuple[list[int], list[int]]]) -> dict[str, dict[str, float]]:
    """``tau_by_context`` over (accepted per pass, context per pass) of each request, offline or served."""
    accepted: dict[str, list[int]] = {}
    for per_round, contexts in requests:
        for n_acc, position in zip(per_round, contexts, strict=True):
            accepted.setdefault(context_bucket(position), []).append(n_acc)
    return {
        label: {"rounds": len(accepted[label]), "tau": 1 + sum(accepted[label]) / len(accepted[label])}
        for label, _ in CONTEXT_BUCKETS
        if label in accepted
    }


# ------------------------------------------------------------------------------------------ sampling


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float().cpu() / temperature, -1), 1, generator=generator))


def accept_draft(
    p: torch.Tensor, draft: int, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[bool, int | None]:
    """Speculative sampling for one draft: (accepted, None) or (rejected, the token resampled from the residual).

    ``p``, ``q``: probabilities over the target vocab; ``q`` None means a point mass on ``draft``.
    """
    q_d = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=generator))
    if u * q_d < float(p[draft]):  # u < p/q without dividing by a q that may underflow
        return True, None
    if q is None:
        residual = p.clone()
        residual[draft] = 0
    else:
        residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
        residual = p
    return False, int(torch.multinomial(residual, 1, generator=generator))


# ------------------------------------------------------------------------------------------- target


@torch.no_grad()
def target_pass(
    model, ids: list[int], cache: DynamicCache, aux_layer_ids: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [T, V] (fp32) of ``ids`` appended to ``cache``, and the concatenated aux states [T, 3Ht] if asked."""
    device = model.get_input_embeddings().weight.device
    # transformers 5 renamed past_key_values to cache (the old name warns, and goes in 5.40)
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(
        input_ids=torch.tensor([ids], device=device),
        use_cache=True,
        output_hidden_states=aux_layer_ids is not None,
        **{cache_kwarg: cache},
    )
    # a target sharded over GPUs (device_map) has its layers' states on different devices
    aux = (
        None
        if aux_layer_ids is None
        else torch.cat([out.hidden_states[i][0].to(out.logits.device) for i in aux_layer_ids], -1)
    )
    return out.logits[0].float(), aux


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    proposer: Proposer | None = None,
    k: int = 0,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    engine_accounting: bool = False,
) -> Generation:
    """Decode up to ``max_new_tokens`` after ``prompt_ids``; speculative with ``proposer`` and ``k`` drafts per round.

    Stops after a token in ``stop_ids`` (kept in the output). Drafts never run past ``max_new_tokens`` unless
    ``engine_accounting`` (see the module's docstring).
    """
    from transformers import DynamicCache  # lazy: heavy (transformers)

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    aux_ids = proposer.aux_layer_ids if proposer is not None else None
    stats = DecodeStats(drafted=[0] * k, accepted=[0] * k)
    per_round: list[int] = []
    context_per_round: list[int] = []
    t0 = time.perf_counter()
    cache = DynamicCache()
    logits, aux = target_pass(model, list(prompt_ids), cache, aux_ids)
    out = [pick(logits[-1], temperature, generator)]
    if proposer is not None:
        proposer.reset(list(prompt_ids) + out, aux)
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        budget = max_new_tokens - len(out)  # a round emits up to drafts + 1 tokens
        drafts: list[int] = []
        q: torch.Tensor | None = None
        if proposer is not None and k > 0 and (budget > 1 or engine_accounting):
            drafts, q = proposer.propose(k if engine_accounting else min(k, budget - 1), temperature, generator)
        logits, aux = target_pass(model, [out[-1]] + drafts, cache, aux_ids)

        if temperature <= 0:
            target_ids = logits.argmax(-1).tolist()
            n_acc = next((i for i, d in enumerate(drafts) if d != target_ids[i]), len(drafts))
            new = drafts[:n_acc] + [target_ids[n_acc]]
        else:
            probs = torch.softmax(logits.cpu() / temperature, -1)  # sampled on the CPU, where the generator lives
            new = []
            for i, d in enumerate(drafts):
                ok, resampled = accept_draft(probs[i], d, None if q is None else q[i], generator)
                new.append(d if ok else resampled)
                if not ok:
                    break
            else:
                new.append(pick(logits[len(drafts)], temperature, generator))
            n_acc = len(new) - 1
        stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        new = new[:budget]
        counted = n_acc if engine_accounting else min(n_acc, len(new))

        rejected = len(drafts) - n_acc
        if rejected:  # negative: tokens to remove (an absolute length is refused by transformers 5)
            cache.crop(-rejected)
        stats.rounds += 1
        stats.emitted += len(new)
        for i in range(len(drafts)):
            stats.drafted[i] += 1
            stats.accepted[i] += i < counted
        if drafts:
            per_round.append(counted)
            context_per_round.append(len(prompt_ids) + len(out))
        out.extend(new)
        if proposer is not None and len(out) < max_new_tokens and out[-1] not in stop_ids:
            proposer.update(new, None if aux is None else aux[: len(new)])
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - t0
    return Generation(out, stats, per_round, context_per_round)

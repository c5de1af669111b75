"""The capture self-check: do the captured hidden states rebuild the target's own next-token log-probabilities?

A capture of the wrong layer, or a final state normed twice, still trains and still reaches a non-trivial
acceptance, so nothing downstream reveals it. The final state is the one captured piece whose meaning can
be checked without running the model: ``log_softmax(lm_head(norm(h_N)))`` at each prompt position must be
the log-probabilities the target itself gives the next token (vLLM returns them as ``prompt_logprobs``).
When the rows eaglekit would write do not match, the alternatives are tried on the raw captured states —
the norm not applied, applied twice, the other RMSNorm convention, another captured layer — and the one
that matches names the cause. The aux states cannot be checked this way; they come from the same request
with the same layer-id convention, so a shifted final id is how a shifted list shows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eaglekit.model.target import FinalNorm
from eaglekit.preflight import CheckResult, fail, ok

# The largest |Δ| (nats) between a rebuilt and a served log-prob that is float noise: float32 states and
# logits agree to ~1e-5; bfloat16 states round each value by up to 2^-9 of itself, which moves a log-prob by
# a few hundredths. A wrong layer or norm moves them by whole nats. Log-probs below FLOOR are left out:
# their absolute error grows with their size and they carry no acceptance.
TOLERANCE = {torch.float32: 1e-3}
TOLERANCE_16BIT = 0.15
FLOOR = -20.0
SERVE_HINT = "restart the server with the command `eaglekit serve-command CONFIG` prints"

Reference = list[dict[int, float] | None]  # per prompt position t: {token: log p(token | tokens < t)}


def parse_prompt_logprobs(entries: list | None) -> Reference:
    """vLLM's ``choices[0].prompt_logprobs``: ``[null, {"id": {"logprob": x, "rank": r, ...}}, ...]``."""
    if not entries:
        return []
    out: Reference = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({int(tok): float(v["logprob"] if isinstance(v, dict) else v) for tok, v in entry.items()})
    return out


@torch.no_grad()
def logprob_gap(final: torch.Tensor, head: torch.Tensor, reference: Reference) -> tuple[float, int]:
    """(max |Δ| in nats, values compared) between log_softmax(final @ headᵀ) and ``reference``.

    ``final`` [L, H] is already through the norm; row t-1 predicts the token at position t.
    """
    rebuilt = torch.log_softmax(final.float() @ head.float().T, dim=-1)
    worst, n = 0.0, 0
    for t, entry in enumerate(reference[: len(final) + 1]):
        if not entry or t == 0:
            continue
        for token, served in entry.items():
            if served > FLOOR and token < rebuilt.shape[1]:
                worst = max(worst, abs(float(rebuilt[t - 1, token]) - served))
                n += 1
    return worst, n


def _conventions(norm: FinalNorm) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways a final state is commonly (mis)converted, described as the check reports them."""
    once = FinalNorm(norm.weight, norm.eps, norm.offset)
    other = FinalNorm(norm.weight, norm.eps, not norm.offset)
    return {
        "the final norm applied once": once,
        "no final norm (the state is already normed)": lambda x: x,
        "the final norm applied twice": lambda x: once(once(x)),
        f"the other RMSNorm convention ({'w' if norm.offset else '(1 + w)'}·x/rms)": other,
    }


def check_capture(
    name: str,
    states: torch.Tensor,
    layer_ids: list[int],
    rows: torch.Tensor,
    norm: FinalNorm,
    head: torch.Tensor,
    reference: Reference,
) -> CheckResult:
    """Compare the rows eaglekit writes with the served log-probs, and name what is off when they differ.

    ``states`` [L, S, H]: the raw captured states, one per entry of ``layer_ids`` in that order (the last is
    the final, pre-norm state); ``rows`` [L, H]: the final state as eaglekit converted it; ``norm``/``head``:
    the target's final norm and lm_head read by name; ``reference``: the server's log-probs of the prompt.
    """
    tolerance = TOLERANCE.get(states.dtype, TOLERANCE_16BIT)
    gap, compared = logprob_gap(rows, head, reference)
    if compared == 0:
        return fail(
            name,
            "the server returned no prompt log-probs to compare with",
            "use a vLLM that answers `prompt_logprobs` in /v1/completions (0.6 or later)",
        )
    final_id, raw_final = layer_ids[-1], states[:, -1]
    if gap <= tolerance:
        return ok(name, f"{compared} log-probs rebuilt from layer {final_id}: max |Δ| {gap:.1e} nats (≤ {tolerance:g})")
    measured = f"the rows eaglekit writes give the server's prompt_logprobs to within {gap:.2f} nats (> {tolerance:g})"

    conventions = _conventions(norm)
    gaps = {label: logprob_gap(convert(raw_final), head, reference)[0] for label, convert in conventions.items()}
    matching = next((label for label, g in gaps.items() if g <= tolerance), None)
    if matching is not None:
        used = next(
            (
                label
                for label, convert in conventions.items()
                if torch.allclose(convert(raw_final).float(), rows.float(), rtol=1e-3, atol=1e-4)
            ),
            "another conversion",
        )
        return fail(
            name,
            f"{measured}: the captured layer-{final_id} state matches with {matching} "
            f"({gaps[matching]:.1e} nats), but the rows were made with {used}",
            "the final norm convention is off: eaglekit must apply the target's norm (read by name, "
            "model.norm.weight) exactly once to the server's pre-norm state",
        )
    for position, layer in enumerate(layer_ids[:-1]):
        g = logprob_gap(norm(states[:, position]), head, reference)[0]
        if g <= tolerance:
            return fail(
                name,
                f"{measured}: the state read as layer {final_id} is not the last layer's output, "
                f"the one read as layer {layer} is ({g:.1e} nats) — the server's layer ids are not {layer_ids}",
                SERVE_HINT,
            )
    best = min(gaps, key=lambda label: gaps[label])
    return fail(
        name,
        f"{measured}, and no captured state rebuilds them with any norm convention (closest: layer {final_id} "
        f"with {best}, {gaps[best]:.2f} nats): the server does not capture layer {final_id} (the last layer's "
        f"output before the norm) — its layer ids are shifted from {layer_ids}, or it serves another model",
        SERVE_HINT + " for this target.model",
    )


@torch.no_grad()
def check_in_process(name: str, features, ids: torch.Tensor, aux_layer_ids: list[int]) -> CheckResult:
    """The cheaper twin for extract's in-process backend: the rows ``features`` (a ``TargetFeatures``) returns for
    ``ids`` [L] against the model's own forward pass — every aux state against ``hidden_states[id]`` of the config's
    ``aux_layer_ids``, and the final rows through lm_head against the model's own log-probs (``check_capture``)."""
    model, layers = features.model, features.layers
    captured: dict[str, torch.Tensor] = {}

    def keep_output(module, args, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    hook = layers[-1].register_forward_hook(keep_output)
    try:
        out = model(ids[None].to(model.device), output_hidden_states=True)
    finally:
        hook.remove()
    feats = features(ids[None], with_logits=False)
    hidden = [h[0] for h in out.hidden_states]
    width = hidden[0].shape[-1]
    for j, layer in enumerate(aux_layer_ids):
        got = feats.aux[0, :, j * width : (j + 1) * width].to(hidden[layer].device)
        if not torch.allclose(got.float(), hidden[layer].float(), rtol=1e-3, atol=1e-4):
            alike = [i for i, h in enumerate(hidden) if torch.allclose(got.float(), h.float(), rtol=1e-3, atol=1e-4)]
            where = f"hidden_states[{alike[0]}]" if alike else "no hidden_states entry"
            return fail(
                name,
                f"aux state {j} should be hidden_states[{layer}] (the residual stream entering decoder layer {layer}) "
                f"and is {where}: the capture's layer ids are off",
                "the aux taps must be forward pre-hooks of model.layers[id], as eaglekit.model.target.TargetFeatures",
            )
    reference = torch.log_softmax(out.logits[0].float(), dim=-1)
    served: Reference = [None]
    for t in range(1, len(ids)):
        tokens = {int(ids[t])} | set(reference[t - 1].topk(5).indices.tolist())
        served.append({k: float(reference[t - 1, k]) for k in tokens})
    cfg = model.config
    eps = getattr(cfg, "rms_norm_eps", None) or 1e-6
    norm = FinalNorm(features.norm.weight.detach(), float(eps), getattr(cfg, "model_type", "").startswith("gemma"))
    states = torch.stack([*(hidden[i] for i in aux_layer_ids), captured["final"][0]], dim=1)
    layer_ids = [*aux_layer_ids, len(layers)]
    return check_capture(name, states, layer_ids, feats.last_hidden[0], norm, features.lm_head.weight.detach(), served)

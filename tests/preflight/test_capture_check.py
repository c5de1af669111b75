"""The capture self-check: rows rebuilt through the target's norm and lm_head against the target's own log-probs.

In process here (the tiny target's Hugging Face forward plays the server: its hidden states are the capture,
its log_softmax the prompt_logprobs, in vLLM's JSON shape); against the real vLLM CPU build in
test_capture_check_vllm.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglekit.config import TargetConfig
from eaglekit.model.target import embedding_and_head, read_final_norm
from eaglekit.preflight.capture import check_capture, parse_prompt_logprobs

LAYERS = [2, 4, 5, 8]  # the tiny target's default aux taps and its final, pre-norm state (8 decoder layers)


@pytest.fixture(scope="module")
def captured(tiny_target):
    """(states [L, 9 layers, H] for HF ids 0..8, pre-norm, the served prompt_logprobs JSON, norm, head)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.randint(5, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    # HF's hidden_states[-1] is after the final norm: take the last layer's output before it, as vLLM stores it
    pre_norm: dict[int, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: pre_norm.update({8: o[0] if isinstance(o, tuple) else o})
    )
    with torch.no_grad():
        model(ids)
    hook.remove()
    states = torch.stack([*out.hidden_states[:8], pre_norm[8]], dim=0)[:, 0].transpose(0, 1)  # [L, 9, H]
    logprobs = torch.log_softmax(out.logits[0].float(), -1)
    served: list = [None]
    for t in range(1, ids.shape[1]):  # position t: its own token and the top 5, keys as strings as JSON has them
        tokens = {int(ids[0, t])} | set(logprobs[t - 1].topk(5).indices.tolist())
        served.append({str(k): {"logprob": float(logprobs[t - 1, k]), "rank": 1} for k in tokens})
    cfg = TargetConfig(model=str(tiny_target))
    _, head = embedding_and_head(model)
    return states, served, read_final_norm(cfg), head


def test_the_right_capture_passes_within_float_noise(captured):
    states, served, norm, head = captured
    picked = states[:, LAYERS]
    result = check_capture("capture", picked, LAYERS, norm(picked[:, -1]), norm, head, parse_prompt_logprobs(served))
    assert result.status == "ok", result.detail
    assert "max |Δ|" in result.detail


def test_a_final_norm_applied_twice_is_named(captured):
    states, served, norm, head = captured
    picked = states[:, LAYERS]
    rows = norm(norm(picked[:, -1]))
    result = check_capture("capture", picked, LAYERS, rows, norm, head, parse_prompt_logprobs(served))
    assert result.status == "fail"
    assert "matches with the final norm applied once" in result.detail
    assert "rows were made with the final norm applied twice" in result.detail, result.detail


def test_a_server_state_that_is_already_normed_is_named(captured):
    states, served, norm, head = captured
    picked = states[:, LAYERS].clone()
    picked[:, -1] = norm(picked[:, -1])  # the server stored the post-norm state; eaglekit norms it again
    result = check_capture("capture", picked, LAYERS, norm(picked[:, -1]), norm, head, parse_prompt_logprobs(served))
    assert result.status == "fail" and "matches with no final norm" in result.detail, result.detail


def test_layer_ids_shifted_by_one_are_named(captured):
    states, served, norm, head = captured
    shifted = states[:, [i - 1 for i in LAYERS]]  # the server captured 1, 3, 4, 7 where 2, 4, 5, 8 were asked
    result = check_capture("capture", shifted, LAYERS, norm(shifted[:, -1]), norm, head, parse_prompt_logprobs(served))
    assert result.status == "fail"
    assert "does not capture layer 8" in result.detail and "shifted from [2, 4, 5, 8]" in result.detail, result.detail
    assert "serve-command" in result.remedy


def test_a_final_state_listed_in_another_place_is_named(captured):
    states, served, norm, head = captured
    swapped = states[:, [2, 4, 8, 5]]  # the ids' order disagrees: layer 8's state sits where 5 is read
    result = check_capture("capture", swapped, LAYERS, norm(swapped[:, -1]), norm, head, parse_prompt_logprobs(served))
    assert result.status == "fail" and "the one read as layer 5 is" in result.detail, result.detail


def test_no_prompt_logprobs_is_a_fail_that_says_so(captured):
    states, _, norm, head = captured
    picked = states[:, LAYERS]
    result = check_capture("capture", picked, LAYERS, norm(picked[:, -1]), norm, head, parse_prompt_logprobs(None))
    assert result.status == "fail" and "no prompt log-probs" in result.detail


# ------------------------------------------------------------------ the in-process twin (extract's hf backend)


def test_in_process_twin_passes_and_names_shifted_aux_taps_and_a_second_norm(tiny_target):
    from transformers import AutoModelForCausalLM

    from eaglekit.model.target import TargetFeatures
    from eaglekit.preflight.capture import check_in_process

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.randint(5, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    right = check_in_process("twin", TargetFeatures(model, [2, 4, 5]), ids, [2, 4, 5])
    assert right.status == "ok", right.detail

    shifted = check_in_process("twin", TargetFeatures(model, [1, 3, 4]), ids, [2, 4, 5])
    assert shifted.status == "fail" and "should be hidden_states[2]" in shifted.detail
    assert "is hidden_states[1]" in shifted.detail, shifted.detail

    class NormedTwice(TargetFeatures):
        def __call__(self, *args, **kwargs):
            feats = super().__call__(*args, **kwargs)
            feats.last_hidden = self.norm(feats.last_hidden)
            return feats

    twice = check_in_process("twin", NormedTwice(model, [2, 4, 5]), ids, [2, 4, 5])
    assert twice.status == "fail" and "made with the final norm applied twice" in twice.detail, twice.detail

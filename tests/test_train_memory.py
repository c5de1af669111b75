"""The step memory model (training/memory.py) against what a real TTT step allocates, at a shape that is none of the
calibration's: the CPU allocator's own account (the profiler's per-op memory), not the model's instrument."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from eaglekit.config import TTTConfig
from eaglekit.divergences import DIVERGENCES
from eaglekit.model.eagle3 import DrafterConfig, Eagle3Drafter
from eaglekit.training.fused import StepKernels
from eaglekit.training.memory import head_chunk_temporaries, kept_bytes_per_token, random_row, step_memory
from eaglekit.training.ttt import ttt_loss

STEPS = 7


def drafter_config() -> DrafterConfig:
    """Widths the calibration (64, two heads) does not use; a target narrower than the drafter."""
    return DrafterConfig(
        hidden_size=96, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=4096, vocab_size=300,
        draft_vocab_size=128, target_hidden_size=80, aux_layer_ids=None, fc_norm=True, norm_output=True,
    )  # fmt: skip


def allocated_by_forward(cfg: DrafterConfig, rows: int, checkpoint: bool) -> int:
    """Bytes the allocator holds for ttt_loss's forward when it returns (what backward will read), net of frees."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    aux, ids, logits, mask = random_row(cfg, rows, seed=1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = ttt_loss(drafter, aux, ids, logits, mask, settings=TTTConfig(steps=STEPS),
                       kernels=StepKernels(checkpoint_steps=checkpoint))  # fmt: skip
    assert out.loss.requires_grad  # the graph, and what it keeps, is alive while the account is read
    return sum(e.self_cpu_memory_usage for e in prof.key_averages())


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpointed", "plain"])
def test_kept_bytes_per_token_match_what_a_real_step_holds_at_another_shape(checkpoint):
    """Checkpointed, a step holds more than autograd saves: its step-0 keys and values and its index tensors live in
    the recomputed steps' closures. The per-token slope of the allocator's account over two row lengths is the
    model's within 2 % (saved-tensor hooks alone gave 7 % less checkpointed)."""
    cfg = drafter_config()
    short, long = (allocated_by_forward(cfg, n, checkpoint) for n in (256, 512))
    measured = (long - short) / 256
    model = kept_bytes_per_token(cfg, STEPS, checkpoint, bf16=False)
    assert measured == pytest.approx(model, rel=0.02), (measured, model)


def test_the_head_loss_transient_follows_the_divergence():
    """The chunk's temporaries are counted on each divergence's code: Jensen-Shannon's (log m and its terms) outnumber
    forward KL's, and the step's forward transient grows with them."""
    kl, jsd = head_chunk_temporaries(DIVERGENCES["kl_div"]()), head_chunk_temporaries(DIVERGENCES["jsd"]())
    assert 5 <= kl < jsd
    cfg = drafter_config()
    at = {
        name: step_memory(
            cfg, 4096, STEPS, trainable=0, frozen=0, bf16=False, device_type="cpu", loss=DIVERGENCES[name]()
        )
        for name in ("kl_div", "jsd")
    }
    assert at["jsd"].transient > at["kl_div"].transient

"""The step memory model (training/memory.py) against what a real TTT step allocates, at a shape that is none of the
calibration's: the CPU allocator's own account (the profiler's per-op memory), not the model's instrument."""

from __future__ import annotations

import pytest
import torch
from test_block_memory import config as block_config
from torch.profiler import ProfilerActivity, profile

from eaglekit.config import TTTConfig
from eaglekit.divergences import DIVERGENCES
from eaglekit.drafters.dflash.memory import block_step_memory
from eaglekit.drafters.dflash.model import DFlashDrafter
from eaglekit.drafters.dflash.objective import block_loss
from eaglekit.drafters.eagle3.fused import StepKernels
from eaglekit.drafters.eagle3.memory import head_chunk_temporaries, kept_bytes_per_token, random_row, step_memory
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.training.memory import Storages, weight_bytes

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


def test_the_storage_counter_counts_a_storage_once_and_only_what_is_alive():
    """The counter both step models keep their bytes with: a tensor and its views (a slice, a transpose, one saved
    for backward) are one storage; parameters and views of them are not the step's; a graph dropped before the step
    returns (a detached figure) keeps nothing, though autograd saved tensors for it."""
    weight = torch.randn(64, 32, requires_grad=True)
    with Storages() as made:
        made.phase = "first"
        kept = weight.exp()  # saves its result: the same storage as ``kept``
        views = [kept[:8], kept.t(), kept.view(-1), weight[:4], weight.t()]
        made.phase = "second"
        sines = views[0].sin()  # saves its input, a view of ``kept``
        figure = weight.exp().sum().detach()  # exp saved its result for a graph now gone
    assert made.alive("first") == 64 * 32 * 4
    assert made.alive("second") == 8 * 32 * 4 + 4  # sin's result and the figure
    assert made.alive() == made.alive("first") + made.alive("second")
    del sines, figure
    assert made.alive() == 64 * 32 * 4


def test_autocast_copies_the_weights_a_step_casts_and_not_the_looked_up_embedding():
    """Both models count autocast's bf16 copy of every weight a matmul reads and none of the frozen embedding's (a
    lookup is not cast): measured on a step of each under CPU autocast (what it keeps when the loss returns). The
    EAGLE-3 head's copy is made and freed per chunk in the fused head loss: counting it errs high."""
    eagle, block = drafter_config(), block_config()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = 37  # no activation of a 37-token row has the bytes of the weights' copies below
    aux, ids, logits, mask = random_row(eagle, rows, seed=0)
    block_aux = torch.randn(1, rows, len(block.aux_layer_ids) * block.target_hidden_size, generator=g)
    argmax = torch.randint(0, block.vocab_size, (1, rows), generator=g)
    steps = {
        "eagle3": lambda d: ttt_loss(d, aux, ids, logits, mask, settings=TTTConfig(steps=STEPS)),
        "block": lambda d: block_loss(d, block_aux, argmax, ids, mask, mask, max_anchors=2, generator=g),
    }
    weights = {  # each model's figure for a drafter of ``t`` trainable and ``f`` frozen parameters
        "eagle3": lambda t, f, bf16: step_memory(
            eagle, 256, STEPS, trainable=t, frozen=f, bf16=bf16, device_type="cpu"
        ),
        "block": lambda t, f, bf16: block_step_memory(block, 256, 1, 8, trainable=t, frozen=f, bf16=bf16),
    }
    for name, drafter in (("eagle3", Eagle3Drafter(eagle)), ("block", DFlashDrafter(block))):
        with Storages() as made, torch.autocast("cpu", dtype=torch.bfloat16):
            out = steps[name](drafter)
        kept = made.alive_sizes()
        del out
        table = 2 * drafter.embed_tokens.weight.numel()  # the bytes of a bf16 copy of the embedding table
        if name == "eagle3":  # its layer's weights are copied (q_proj's among them), the table not
            assert 2 * drafter.midlayer.self_attn.q_proj.weight.numel() in kept and table not in kept
        else:  # the frozen head, as large as the table, is copied for the gradient of its input; the table not
            assert drafter.lm_head.weight.shape == drafter.embed_tokens.weight.shape and kept.count(table) == 1

        trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in drafter.parameters()) - trainable
        embedding = drafter.embed_tokens.weight.numel()
        for bf16 in (True, False):
            got = weights[name](trainable, frozen, bf16).weights
            copies = 2 * (trainable + frozen - embedding) if bf16 else 0
            assert got == weight_bytes(trainable, frozen, bf16=bf16, looked_up=embedding)
            assert got == 16 * trainable + 4 * frozen + copies

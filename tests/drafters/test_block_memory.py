"""The block drafters' step memory (training/block_memory.py): the kept bytes the model scales from small calibration
drafters against the storages (memory.Storages) a real block step of another shape keeps; the attention mask kept once
for all layers (and the step unchanged by it); `plan` and train's pre-flight sizing and refusing a DFlash row."""

from __future__ import annotations

import sys

import pytest
import torch
from support.fake_nvml import GB, fake_pynvml, gpu
from test_preflight_gpus import make_ctx
from transformers import AutoConfig

from eaglekit.drafters.dflash import model as dflash_model
from eaglekit.drafters.dflash.memory import BASE, kept_bytes, kept_per_shape
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, window_mask
from eaglekit.drafters.dflash.objective import block_loss
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter


def config(cls=DFlashConfig, **fields) -> DFlashConfig:
    """A drafter of widths other than the calibration's (BASE), so that the model's width scaling is exercised."""
    values = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                  max_position_embeddings=4096, vocab_size=300, target_hidden_size=96, aux_layer_ids=[1, 2, 3],
                  block_size=4, mask_token_id=3)  # fmt: skip
    return cls(**values | fields)


@pytest.mark.parametrize(
    ("cls", "fields", "bf16"),
    [
        (DFlashConfig, {}, True),
        (DFlashConfig, {}, False),
        (DSparkConfig, {"markov_rank": 40, "sliding_window": 64}, True),
    ],
)
def test_the_kept_bytes_scaled_from_calibration_drafters_are_what_a_real_step_keeps(cls, fields, bf16):
    """At a shape none of the calibration drafters has, and row lengths and anchor counts they did not run, the
    model's growth of the kept bytes equals what is counted on the real step (constants, such as autocast's
    weight copies, cancel in the difference)."""
    cfg = config(cls, **fields)
    assert cfg.hidden_size != BASE["hidden_size"] and cfg.vocab_size != BASE["vocab_size"]
    kept = kept_per_shape(cfg, bf16)
    (short, few), (long, many) = (150, 5), (300, 12)
    model = kept.at(long, many * cfg.block_size) - kept.at(short, few * cfg.block_size)
    measured = kept_bytes(cfg, long, many, bf16).total - kept_bytes(cfg, short, few, bf16).total
    assert model == pytest.approx(measured, rel=0.01)
    # a rank splitting the row projects its own positions' context, and reads the whole row's
    half = kept_bytes(cfg, long // 2, few, bf16).projected - kept_bytes(cfg, short // 2, few, bf16).projected
    assert kept.per_projected * (long - short) / 2 == pytest.approx(half, rel=0.01)
    assert kept.per_read > 0


def test_the_attention_mask_is_kept_once_for_all_layers():
    """The [Q, L + Q] mask is the step's only tensor over (query, key) pairs: one bias in the compute dtype for the
    whole drafter, not one per layer (each layer's SDPA converting the bool mask and keeping its copy)."""
    for layers in (1, 3):
        for bf16, size in ((True, 2), (False, 4)):
            assert kept_per_shape(config(num_hidden_layers=layers), bf16).per_pair == size


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_step_is_the_same_as_with_the_bool_mask_given_to_every_layer(monkeypatch, window, bf16):
    """The shared bias is exactly the one SDPA makes of the bool mask: loss and every gradient are bit-identical."""
    cls, drafter_cls = (DSparkConfig, DSparkDrafter) if window else (DFlashConfig, DFlashDrafter)
    cfg = config(cls, sliding_window=window)

    def step() -> list[torch.Tensor]:
        torch.manual_seed(0)
        drafter = drafter_cls(cfg)
        g = torch.Generator().manual_seed(1)
        aux = torch.randn(2, 80, 3 * cfg.target_hidden_size, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (2, 80), generator=g)
        argmax = torch.randint(0, cfg.vocab_size, (2, 80), generator=g)
        positions = torch.cat([torch.arange(50), torch.arange(30)]).expand(2, 80)  # two packed documents a row
        ones = torch.ones_like(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = block_loss(drafter, aux, argmax, ids, ones, ones, positions, max_anchors=9, generator=g)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad for p in drafter.parameters() if p.grad is not None]

    shared = step()
    monkeypatch.setattr(dflash_model, "additive_mask", lambda mask, dtype: mask[:, None])  # SDPA converts per layer
    per_layer = step()
    assert len(shared) == len(per_layer) > 10
    assert all(torch.equal(a, b) for a, b in zip(shared, per_layer, strict=True))


def test_the_bias_rows_are_16_aligned_for_cudas_memory_efficient_kernel():
    """An unaligned row stride makes CUDA's SDPA pad a copy of the bias on every layer (kept for its backward)."""
    mask = torch.rand(2, 20, 170) < 0.5
    bias = dflash_model.additive_mask(mask, torch.bfloat16)
    assert bias.shape == (2, 1, 20, 170) and bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1
    assert torch.equal(bias[:, 0] == 0, mask) and torch.isneginf(bias[:, 0][~mask]).all()


def test_the_window_mask_is_the_offset_rule():
    queries, keys = torch.tensor([[0, 5, 9, 30]]), torch.arange(-3, 40)[None]
    offset = queries[:, :, None] - keys[:, None, :]
    assert torch.equal(window_mask(queries, keys, 7), (offset >= 0) & (offset < 7))


def test_preflight_refuses_a_dflash_row_that_does_not_fit_and_plan_gives_its_memory(tmp_path, tiny_target, monkeypatch):
    """One 65,536-token row of a DFlash drafter: `plan` gives the step's memory (one figure: the block objective has
    no activation checkpointing) and one rank's when N ranks split the row; train's pre-flight refuses it on a GPU
    that cannot hold it, naming shorter rows and the ranks that fit (without checkpointing, which the block
    objective does not have), and passes it on one that can, and split over those ranks."""
    from eaglekit.contract import Sizes
    from eaglekit.progress import human_bytes
    from eaglekit.stages.train import estimate, step_memory_both, step_memory_check

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    draft = {"architecture": "dflash", "mask_token_id": 0}
    train = {"packing": True, "pack_length": 65536, "batch_size": 1, "draft": draft}
    ctx = make_ctx(tmp_path, tiny_target, stage="train", train=train)
    both = step_memory_both(ctx.cfg)
    assert both is not None
    step = both[0]
    assert both[1] is step and step.context_parallel == 1
    # the row's batch: its three taps of aux features (bf16), the target's argmax and the indices, 8 bytes each a
    # token; not the target's logits over its whole vocabulary (514 tokens, fp32), which the block objective never reads
    hidden = AutoConfig.from_pretrained(tiny_target).hidden_size
    assert step.batch == 65536 * (3 * hidden * 2 + 8 + 4 * 8) < 65536 * 4 * 514 and step.activations > 0
    two, four = (step_memory_both(ctx.cfg, n)[0] for n in (2, 4))  # type: ignore[index]
    assert four.total < two.total < step.total and four.context_parallel == 4 and four.gathered > 0
    assert four.batch == (65536 // 4 + 16) * step.batch // 65536  # a quarter of the row's, and a block's halo

    gpu_bytes = (four.total + two.total) / 2
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([gpu(0, used=0, total=gpu_bytes / GB)]))
    refused = step_memory_check(ctx)
    assert refused.status == "fail" and "65,536 tokens a micro-batch" in refused.detail, refused.detail
    assert "does not fit" in refused.detail and human_bytes(step.total) in refused.detail
    assert (
        "train.pack_length" in refused.remedy and "train.context_parallel: 4 (4 GPUs share each row" in refused.remedy
    )
    assert "activation_checkpointing" not in refused.remedy

    split = make_ctx(tmp_path, tiny_target, stage="train", train={**train, "context_parallel": 4})
    fits = step_memory_check(split)
    assert fits.status == "ok" and "a rank of 4 splitting each row" in fits.detail

    sizes = Sizes(None, None, None, None, None, None, None, None, "bfloat16")
    how = estimate(ctx, sizes).how
    [line] = [h for h in how if h.startswith("GPU memory of a step")]
    assert f"at 65,536 tokens (bf16): {human_bytes(step.total)}" in line
    assert not [h for h in how if "activation_checkpointing" in h]
    [ranks] = [h for h in how if "train.context_parallel" in h]
    assert "checkpointed" not in ranks and f"N=4 {human_bytes(four.total)}" in ranks

"""Sliding-window EAGLE-3 drafters (train.draft.sliding_window): the TTT loss and gradients, the decoding forward and
the exported config against dense references written from how vLLM serves the window (a query at position p sees
positions p - window < s <= p)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_drafter_ttt import grads, make_batch, make_drafter, reference_ttt, tiny_config
from test_packing import documents, lay_out

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.model import DraftKVCache
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.errors import UsageError

WINDOW = 5


@pytest.mark.parametrize(("steps", "variant"), [(1, {}), (4, {}), (4, {"fc_norm": True, "norm_output": True})])
def test_windowed_ttt_matches_a_dense_reference_float64(steps, variant):
    cfg = tiny_config(sliding_window=WINDOW, **variant)
    drafter = make_drafter(cfg)
    aux, ids, tl, lm, am, ind = make_batch(cfg, length=16)
    out = ttt_loss(drafter, aux, ids, tl, lm, am, settings=TTTConfig(steps=steps, decay=0.8), target_in_draft=ind)
    got = grads(drafter, out.loss)
    ref_loss, ref_lk, _, ref_count = reference_ttt(drafter, aux, ids, tl, lm, am, steps, 0.8, ind, window=WINDOW)
    want = grads(drafter, ref_loss)
    assert out.count_k == ref_count
    assert out.loss_k == pytest.approx(ref_lk, rel=1e-10)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-8, atol=1e-10, msg=name)
    # the window changes the loss: a full-attention drafter with the same weights scores otherwise
    full, _, _, _ = reference_ttt(drafter, aux, ids, tl, lm, am, steps, 0.8, ind)
    assert abs(full.item() - ref_loss.item()) > 1e-6


def test_windowed_ttt_on_packed_rows_equals_each_document_alone_float64():
    """Packed rows: the window never reaches into the document before (its start bounds the keys as well)."""
    cfg = tiny_config(sliding_window=WINDOW)
    drafter = make_drafter(cfg)
    docs = documents(cfg, [9, 12, 4])
    aux, ids, logits, loss_mask, attention, in_draft, positions = lay_out(docs, [[0, 1, 2]])
    packed = ttt_loss(drafter, aux, ids, logits, loss_mask, attention, settings=TTTConfig(steps=3), target_in_draft=in_draft,
                      position_ids=positions)  # fmt: skip
    alone = [
        ttt_loss(
            drafter,
            *(t[None] for t in (d[0], d[1], d[2], d[3])),
            None,
            settings=TTTConfig(steps=3),
            target_in_draft=d[4][None],
        )
        for d in docs
    ]
    for k in range(3):
        total = sum(a.loss_k[k] * a.count_k[k] for a in alone)
        assert packed.count_k[k] == sum(a.count_k[k] for a in alone)
        assert packed.loss_k[k] * packed.count_k[k] == pytest.approx(total, rel=1e-10)


def test_windowed_forward_matches_its_cache_and_a_dense_mask():
    cfg = tiny_config(sliding_window=WINDOW)
    drafter = make_drafter(cfg)
    aux, ids, _, _, _, _ = make_batch(cfg, b=2, length=14, pad=False)
    feature = drafter.fuse(aux)
    tokens = F.pad(ids[:, 1:], (0, 1))
    pos = torch.arange(14).expand(2, 14)
    full, _ = drafter(tokens, feature, pos)
    cache = DraftKVCache()
    stepwise = torch.cat([drafter(tokens[:, t : t + 1], feature[:, t : t + 1], pos[:, t : t + 1], cache)[0]
                          for t in range(14)], 1)  # fmt: skip
    torch.testing.assert_close(stepwise, full, rtol=1e-10, atol=1e-10)
    # the first WINDOW positions see all before them, as a full-attention drafter with these weights does
    plain = make_drafter(tiny_config())
    plain.load_state_dict(drafter.state_dict())
    plain_logits, _ = plain(tokens, feature, pos)
    torch.testing.assert_close(full[:, :WINDOW], plain_logits[:, :WINDOW], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(full[:, WINDOW:], plain_logits[:, WINDOW:])
    # each later position equals a full-attention forward of its own window alone, RoPE positions kept
    for t in (WINDOW, 9, 13):
        lo = t - WINDOW + 1
        alone, _ = plain(tokens[:, lo : t + 1], feature[:, lo : t + 1], pos[:, lo : t + 1])
        torch.testing.assert_close(full[:, t], alone[:, -1], rtol=1e-10, atol=1e-10)


def test_a_window_no_longer_than_the_ttt_chain_is_refused():
    cfg = tiny_config(sliding_window=3)
    drafter = make_drafter(cfg)
    aux, ids, tl, lm, am, _ = make_batch(cfg)
    with pytest.raises(UsageError, match="sliding window"):
        ttt_loss(drafter, aux, ids, tl, lm, am, settings=TTTConfig(steps=3))
    with pytest.raises(UsageError, match="sliding_window"):
        tiny_config(sliding_window=1)


def test_export_writes_the_window_as_vllm_reads_it_and_reads_it_back(tmp_path):
    from eaglekit.drafters.eagle3.checkpoint import load_drafter, save_legacy, save_speculators

    drafter = make_drafter(tiny_config(sliding_window=64), dtype=torch.float32)
    save_legacy(drafter, tmp_path / "eagle3")
    save_speculators(drafter, tmp_path / "speculators", "org/target", ["LlamaForCausalLM"], 3)
    legacy = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    layer = json.loads((tmp_path / "speculators" / "config.json").read_text())["transformer_layer_config"]
    for config in (legacy, layer):  # vllm/model_executor/models/llama.py: layer_types[i] of the draft layer
        assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 64
    for form in ("eagle3", "speculators"):
        loaded, _ = load_drafter(tmp_path / form)
        assert loaded.config.sliding_window == 64
    plain = make_drafter(tiny_config(), dtype=torch.float32)
    save_legacy(plain, tmp_path / "plain")
    assert "layer_types" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_sliding_window_is_a_llama_and_block_drafter_key():
    from eaglekit.config import DRAFT_MODELS

    for architecture in ("llama", "dflash", "dspark"):  # the block drafters: tests/drafters/test_dflash_window.py
        assert DRAFT_MODELS[architecture](architecture=architecture, sliding_window=2048).sliding_window == 2048
    with pytest.raises(ValueError, match="architecture mla does not read sliding_window"):
        DRAFT_MODELS["mla"](sliding_window=2048)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_batch_no_chain_of_which_reaches_the_last_steps_trains(window):
    """Every document shorter than the TTT chain: the last steps have no chain at all (this crashed reshaping an
    empty attention output), and the loss and gradients are those of the steps that have chains."""
    from test_packing import documents

    cfg = tiny_config(sliding_window=window)
    drafter = make_drafter(cfg)
    doc = documents(cfg, [4])[0]
    out = ttt_loss(drafter, *(t[None] for t in doc[:4]), None, settings=TTTConfig(steps=window - 1 if window else 5),
                   target_in_draft=doc[4][None])  # fmt: skip
    assert out.count_k[0] > 0 and out.count_k[-1] == 0
    assert all(g.isfinite().all() for g in grads(drafter, out.loss).values())


@pytest.mark.parametrize(
    ("variant", "window"),
    [("llama", None), ("mla-yarn", None), ("llama-eagle3.1", None), ("llama", WINDOW), ("llama-eagle3.1", WINDOW)],
)
def test_recomputed_ttt_steps_give_the_same_loss_and_gradients_float64(variant, window):
    """train.ttt.activation_checkpointing: every TTT step's layer recomputed in backward gives the loss and gradients
    of the step that kept its activations (packed rows, so step 0 runs the span attention too)."""
    from test_drafter_ttt import VARIANTS

    from eaglekit.drafters.eagle3.fused import REFERENCE, StepKernels

    cfg = tiny_config(sliding_window=window, **VARIANTS[variant])
    drafter = make_drafter(cfg)
    aux, ids, logits, loss_mask, attention, in_draft, positions = lay_out(
        documents(cfg, [9, 12, 4, 7]), [[0, 1], [2, 3]]
    )
    outs, grad_sets = [], []
    for kernels in (REFERENCE, StepKernels(checkpoint_steps=True)):
        out = ttt_loss(drafter, aux, ids, logits, loss_mask, attention, settings=TTTConfig(steps=4), target_in_draft=in_draft,
                       position_ids=positions, kernels=kernels)  # fmt: skip
        outs.append(out)
        grad_sets.append(grads(drafter, out.loss))
    assert outs[0].loss.item() == outs[1].loss.item() and outs[0].loss_k == outs[1].loss_k
    for name in grad_sets[0]:
        torch.testing.assert_close(grad_sets[1][name], grad_sets[0][name], rtol=1e-12, atol=1e-14, msg=name)

"""The block drafters (DFlash, DSpark) read only the target's next token: ``Features`` gives their objective the
target's argmax computed in chunks ([B, L] int64), never its [B, L, V] fp32 logits, and a training step (loss,
figures, every gradient) is the one the full logits' argmax gave, from the live target and from stored rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglekit.config import TrainConfig
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.registry import FAMILIES
from eaglekit.model.target import target_argmax
from eaglekit.training.data import Batch
from eaglekit.training.features import Features

AUX = [0, 1, 3]


def drafter_for(family: str, hf) -> DFlashDrafter:
    cls, drafter_cls = (DSparkConfig, DSparkDrafter) if family == "dspark" else (DFlashConfig, DFlashDrafter)
    extra = {"markov_rank": 8} if family == "dspark" else {}
    cfg = cls(hidden_size=hf.hidden_size, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
              max_position_embeddings=512, vocab_size=hf.vocab_size, target_hidden_size=hf.hidden_size,
              aux_layer_ids=AUX, block_size=4, mask_token_id=0, **extra)  # fmt: skip
    torch.manual_seed(0)
    return drafter_cls(cfg)


def token_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (2, 40), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 31:] = 0  # a right-padded row
    ids[1, 31:] = 0
    return Batch(ids, attention, attention.clone())


def features_for(mode: str, model, batch: Batch) -> tuple[Features, Batch]:
    """The training loop's Features over the whole vocabulary (a block family's t2d): online from the live target;
    offline from the target's stored rows (bf16, as extraction writes them) and its head."""
    everything = torch.ones(model.config.vocab_size, dtype=torch.bool)
    cpu = torch.device("cpu")
    if mode == "online":
        return Features(Path("unused"), everything, cpu, AUX, torch.float32, target_model=model), batch
    from eaglekit.model.target import TargetFeatures

    f = TargetFeatures(model, AUX)(batch.input_ids, batch.attention_mask, with_logits=False)
    rows = Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, f.aux.bfloat16(), f.last_hidden.bfloat16())
    # the stored and streamed rows take the same path through Features (streamed only skips opening the store)
    return Features(Path("unused"), everything, cpu, AUX, torch.float32, head=model.lm_head.weight.detach(),
                    streamed=True), rows  # fmt: skip


def step(objective, inputs: tuple) -> tuple:
    torch.manual_seed(7)  # the anchors: the same draw in both steps
    loss, figures = objective(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return loss.detach(), figures, grads


@pytest.mark.parametrize("mode", ["online", "offline"])
@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_a_block_step_on_the_chunked_argmax_is_the_step_on_the_full_logits(tiny_target, family, mode):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    batch = token_batch(vocab)
    features, rows = features_for(mode, model, batch)
    objective = FAMILIES[family].training.objective(
        drafter_for(family, model.config), TrainConfig(draft={"architecture": family, "mask_token_id": 0}),
        torch.device("cpu"),
    )  # fmt: skip
    assert objective.reads == "argmax"

    inputs = features(rows, objective.reads)
    aux, ids, target, loss_mask, attention, in_draft, positions = inputs
    assert target.dtype == torch.int64 and target.shape == ids.shape and in_draft is None
    assert not [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == vocab]

    # before: the target's logits over its whole vocabulary (EAGLE-3's reading, t2d all of it), their argmax
    full = features(rows)
    assert full[2].shape == (*ids.shape, vocab) and full[2].dtype == torch.float32
    assert torch.equal(full[2].argmax(-1), target)
    assert torch.equal(full[0], aux)
    got = step(objective.module, inputs)
    objective.module.zero_grad(set_to_none=True)
    want = step(objective.module, (full[0], ids, full[2].argmax(-1), loss_mask, attention, None, positions))
    assert torch.equal(got[0], want[0])
    assert got[1] == want[1]
    assert got[2].keys() == want[2].keys() and "drafter.fc.weight" in got[2]
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def test_the_chunked_argmax_equals_the_full_logits_argmax_across_chunks():
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(3, 50, 16, generator=g), torch.randn(300, 16, generator=g)
    got = target_argmax(hidden, head, chunk_elements=300 * 7)  # 7 rows a chunk: the 150 rows in 22 chunks
    assert got.dtype == torch.int64 and got.shape == (3, 50)
    assert torch.equal(got, (hidden @ head.T).argmax(-1))

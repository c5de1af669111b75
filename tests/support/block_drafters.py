"""What the DFlash and DSpark tests share: a block drafter trained on the tiny corpus with online target features, the
held-out prompts, and one drafting round computed two ways (the proposer's cache, and from scratch)."""

from __future__ import annotations

import random

import torch

from eaglekit.drafters.dflash.objective import block_loss
from eaglekit.model.target import TargetFeatures, target_argmax
from eaglekit.speculative.decode import generate
from eaglekit.tiny import sample_tasks
from eaglekit.tiny.build import batch_tensors, encode


def train_block_drafter(model, tok, drafter, steps: int = 120) -> tuple:
    """``drafter`` (DFlash or DSpark, freshly built) trained ``steps`` AdamW steps of 8 rows on the tiny corpus
    (seed 0), its embeddings and head the target's; returns (drafter in eval mode, block τ and loss per step)."""
    drafter.take_target(model.get_input_embeddings().weight, model.lm_head.weight)
    features = TargetFeatures(model, drafter.config.aux_layer_ids)
    rows = encode(tok, sample_tasks(256, 0), random.Random(0))
    optim = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    taus, losses = [], []
    for step in range(steps):
        ids, labels, attention = batch_tensors([rows[(step * 8 + i) % len(rows)] for i in range(8)], 0)
        f = features(ids, attention, with_logits=False)
        argmax = target_argmax(f.last_hidden, model.lm_head.weight)
        out = block_loss(drafter, f.aux, argmax, ids, (labels != -100).long(), attention, generator=generator)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
        taus.append(out.block_tau)
        losses.append(float(out.loss.detach()))
    return drafter.eval(), taus, losses


def heldout_prompts(tok, n: int) -> list[list[int]]:
    return [ids[:start] for ids, start in encode(tok, sample_tasks(n, 1, "heldout"), random.Random(1))]


def one_round_two_ways(model, drafter, proposer, prompt: list[int], drafts: int, masks: int, with_hidden: bool = False):
    """One drafting round after a prompt and six verified reply tokens: the ``drafts`` tokens ``proposer`` drafts
    from its cached context, and the drafter's output recomputed by one uncached forward over the whole context
    for the query [last verified token, mask × ``masks``]. Returns (cached drafts, that output's logits, the last
    verified token; ``with_hidden``: and the output's normed hidden states)."""
    features = TargetFeatures(model, drafter.config.aux_layer_ids)
    out = generate(model, prompt, 20)
    head = prompt + out.tokens[:1]
    proposer.reset(head, features(torch.tensor([prompt]), with_logits=False).aux[0])
    proposer.update(
        out.tokens[1:6], features(torch.tensor([head[:-1] + out.tokens[:5]]), with_logits=False).aux[0, len(prompt) :]
    )
    cached, _ = proposer.propose(drafts, 0.0, None)

    ids = prompt + out.tokens[:5]
    context = drafter.context(features(torch.tensor([ids]), with_logits=False).aux)
    positions = torch.arange(len(ids))[None]
    kv = drafter.context_kv(context, positions)
    query = torch.tensor([[out.tokens[5]] + [drafter.config.mask_token_id] * masks])
    hidden = drafter.final_hidden(
        query, torch.arange(len(ids), len(ids) + masks + 1)[None], kv, context_positions=positions
    )
    logits = drafter.logits(hidden)
    if with_hidden:
        return cached, logits[0], out.tokens[5], hidden[0]
    return cached, logits[0], out.tokens[5]

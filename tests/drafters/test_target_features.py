"""The target as a feature source: hook-captured aux states, final normed hidden, chunked draft-vocab logits."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.target import TargetFeatures, TargetHead, default_aux_layers, draft_logits

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def tiny(cls, config_cls, seed=0):
    torch.manual_seed(seed)
    return cls(config_cls(**SMALL)).eval()


def batch(seed=1, b=3, length=17, vocab=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding
    mask[2, 5:] = 0
    return ids, mask


def draft_vocab(vocab=97, every=3):
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[::every] = True
    return t2d


@pytest.mark.parametrize("cls,config_cls", [(LlamaForCausalLM, LlamaConfig), (Qwen3ForCausalLM, Qwen3Config)])
def test_features_equal_output_hidden_states(cls, config_cls):
    model = tiny(cls, config_cls)
    ids, mask = batch()
    t2d = draft_vocab()
    aux_ids = default_aux_layers(SMALL["num_hidden_layers"])
    assert aux_ids == [2, 4, 5]
    feats = TargetFeatures(model, aux_ids, t2d)(ids, mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = ref.hidden_states
    torch.testing.assert_close(feats.aux, torch.cat([hs[i] for i in aux_ids], dim=-1), rtol=0, atol=0)
    # the last entry of hidden_states is after the final norm: the state the lm_head reads
    torch.testing.assert_close(feats.last_hidden, hs[-1], rtol=0, atol=0)
    torch.testing.assert_close(feats.target_logits, ref.logits[..., t2d], rtol=1e-6, atol=1e-6)
    assert torch.equal(feats.target_in_draft, t2d[ref.logits.argmax(-1)])
    assert feats.target_in_draft.any() and not feats.target_in_draft.all()


def test_aux_index_is_the_input_of_that_layer():
    """hidden_states index i = the input of decoder layer i (index 0 = the embeddings)."""
    model = tiny(LlamaForCausalLM, LlamaConfig)
    ids, mask = batch()
    feats = TargetFeatures(model, [0, 1, 7], draft_vocab())(ids, mask, with_logits=False)
    h = SMALL["hidden_size"]
    torch.testing.assert_close(feats.aux[..., :h], model.model.embed_tokens(ids), rtol=0, atol=0)
    assert feats.target_logits is None
    # no hook stays registered after the call
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_chunked_logits_equal_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16)
    weight = torch.randn(50, 16)
    t2d = draft_vocab(50, every=2)
    full = hidden @ weight.T
    for chunk in (50, 123, 10_000):  # one row, a few rows, everything at once
        logits, in_draft = draft_logits(hidden, weight, t2d, chunk_elements=chunk)
        torch.testing.assert_close(logits, full[..., t2d], rtol=1e-6, atol=1e-6)
        assert torch.equal(in_draft, t2d[full.argmax(-1)])
    head_logits, head_in = TargetHead(weight, t2d)(hidden)
    torch.testing.assert_close(head_logits, full[..., t2d], rtol=1e-6, atol=1e-6)
    assert torch.equal(head_in, t2d[full.argmax(-1)])


def test_unknown_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(EaglekitError, match="GPT2LMHeadModel.*model.model.layers"):
        TargetFeatures(model, [0, 1, 1])


def test_aux_ids_out_of_range():
    with pytest.raises(UsageError, match=r"\[2, 4, 8\].*8 decoder layers"):
        TargetFeatures(tiny(LlamaForCausalLM, LlamaConfig), [2, 4, 8])

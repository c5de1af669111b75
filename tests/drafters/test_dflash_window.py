"""Sliding-window block drafters (train.draft.sliding_window with architecture dflash or dspark): the windowed
attention against a dense reference that lists each query's keys by hand, training's forward against the cached
decoding, the exported config as vLLM 0.32 reads it (its own ``_resolve_layer_attention`` on our config.json), the
window as vLLM's CPU kernel applies it, and a windowed drafter trained on the tiny target served by the real vLLM
CPU build at its offline acceptance.

The window, as both engines serve a DFlash layer whose ``layer_types`` entry is "sliding_attention": the query at
position p sees the keys (context and block) at positions p - W < k <= p, so the block becomes causal."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from support.block_drafters import heldout_prompts, one_round_two_ways, train_block_drafter
from support.helpers import write_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.drafters.dflash.checkpoint import load_dflash, read_dflash_config, save_dflash
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_mask_token_id
from eaglekit.drafters.dflash.objective import block_attention_mask, document_ids
from eaglekit.drafters.dflash.proposer import BlockProposer
from eaglekit.drafters.dspark.checkpoint import read_dspark_config, save_dspark
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.drafters.dspark.proposer import DSparkProposer
from eaglekit.errors import UsageError
from eaglekit.model.layers import apply_rope
from eaglekit.model.target import default_aux_layers
from eaglekit.speculative.decode import generate

WINDOW = 5
BLOCK = 4


def small_config(**overrides) -> DFlashConfig:
    values = dict(
        hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
        vocab_size=40, target_hidden_size=12, aux_layer_ids=[1, 2, 3], block_size=BLOCK, mask_token_id=39,
    )  # fmt: skip
    return DFlashConfig(**(values | overrides))


def random_drafter(cfg: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = (DSparkDrafter(cfg) if isinstance(cfg, DSparkConfig) else DFlashDrafter(cfg)).double()
    with torch.no_grad():  # norms away from 1, so a wrong key or norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter.eval()


def reference_block(drafter, context, context_positions, query_ids, query_positions, sees) -> torch.Tensor:
    """One block's logits [Q, V], each query attending exactly the keys ``sees(i, j)`` lists (j < C: context j,
    else block slot j - C), one query and one head at a time."""
    a0 = drafter.layers[0].self_attn
    n_heads, n_kv, d = a0.n_heads, a0.n_kv, a0.head_dim
    c, q_len = context.shape[0], query_ids.shape[0]
    cos_c, sin_c = drafter.rotary(context_positions[None], context.dtype)
    cos_q, sin_q = drafter.rotary(query_positions[None], context.dtype)
    h = drafter.embed_tokens(query_ids)
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(1, q_len, n_heads, d)), cos_q, sin_q)[0]
        kc, vc = attn.keys_values(context[None], cos_c, sin_c)
        kq, vq = attn.keys_values(x[None], cos_q, sin_q)
        keys, values = torch.cat([kc[0], kq[0]]), torch.cat([vc[0], vq[0]])
        out = torch.zeros(q_len, n_heads, d, dtype=h.dtype)
        for i in range(q_len):
            seen = [j for j in range(c + q_len) if sees(i, j)]
            for head in range(n_heads):
                kv = head // (n_heads // n_kv)
                weights = (keys[seen, kv] @ q[i, head] * d**-0.5).softmax(0)
                out[i, head] = weights @ values[seen, kv]
        h = h + attn.o_proj(out.flatten(-2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.lm_head(drafter.norm(h))  # the drafter's dtype: fp64 here, as its forward gives


def packed_row(cfg: DFlashConfig, lengths: list[int], seed: int = 1):
    """Documents of ``lengths`` packed in one row: (ids [1, L], aux [1, L, 3*Ht], positions [1, L], attention)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size - 1, (1, total), generator=g)
    aux = torch.randn(1, total, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, aux, positions, torch.ones(1, total, dtype=torch.long)


@pytest.mark.parametrize("window", [None, WINDOW, 2])
def test_training_forward_matches_a_dense_reference_with_explicit_masking(window):
    """Packed documents of 9 and 14 tokens, blocks anchored in both: each block sees its own document's context
    before the anchor and, windowed, only the keys p - W < k <= p of each query p, its block causally."""
    cfg = small_config(sliding_window=window)
    drafter = random_drafter(cfg)
    ids, aux, positions, attention = packed_row(cfg, [9, 14])
    anchors = torch.tensor([[2, 7, 10, 15, 21]])  # the last two blocks run past the row / the window
    docs = document_ids(attention, positions)
    query_ids = torch.full((1, anchors.shape[1], BLOCK), cfg.mask_token_id)
    query_ids[:, :, 0] = ids.gather(1, anchors)
    query_positions = positions.gather(1, anchors)[:, :, None] + torch.arange(BLOCK)
    kv = drafter.context_kv(drafter.context(aux), positions)
    mask = block_attention_mask(docs, anchors, BLOCK)
    got = drafter(query_ids.flatten(1), query_positions.flatten(1), kv, mask, positions)[0].view(-1, BLOCK, 40)

    context = drafter.context(aux)[0]
    for n, a in enumerate(anchors[0].tolist()):
        doc = [j for j in range(ids.shape[1]) if docs[0, j] == docs[0, a] and j < a]  # own document, before a
        p = query_positions[0, n]

        def sees(i: int, j: int, doc=doc, p=p) -> bool:
            if window is None:
                return True  # every context key of the document, the whole block
            key = positions[0, doc[j]] if j < len(doc) else p[j - len(doc)]
            return 0 <= int(p[i] - key) < window

        want = reference_block(drafter, context[doc], positions[0, doc], query_ids[0, n], p, sees)
        torch.testing.assert_close(got[n], want, rtol=1e-6, atol=1e-6, msg=f"anchor {a}")
    if window is not None:  # the window is not vacuous: the unwindowed drafter drafts otherwise
        full = drafter(query_ids.flatten(1), query_positions.flatten(1), kv, mask, positions)
        drafter.config.sliding_window = None
        assert not torch.allclose(full, drafter(query_ids.flatten(1), query_positions.flatten(1), kv, mask))


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_cached_decoding_equals_the_training_forward_at_every_anchor(family):
    """The proposer's cache (trimmed to the window's last W-1 positions, filled over several rounds) gives each
    block the logits training computes for the same anchor from the whole row."""
    cfg = small_config(sliding_window=WINDOW)
    if family == "dspark":
        cfg = DSparkConfig(**cfg.to_dict(), markov_rank=4)
    drafter = random_drafter(cfg)
    ids, aux, positions, attention = packed_row(cfg, [20])
    anchors = torch.arange(1, 17)[None]
    query_ids = torch.full((1, 16, BLOCK), cfg.mask_token_id)
    query_ids[:, :, 0] = ids.gather(1, anchors)
    kv = drafter.context_kv(drafter.context(aux), positions)
    mask = block_attention_mask(document_ids(attention, positions), anchors, BLOCK)
    trained = drafter(query_ids.flatten(1), (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1), kv, mask, positions)
    trained = trained[0].view(16, BLOCK, -1)

    proposer = (DSparkProposer if family == "dspark" else BlockProposer)(drafter)
    row = ids[0].tolist()
    proposer.reset(row[:2], aux[0, :1])
    for a in range(1, 17):
        if a > 1:
            proposer.update(row[a : a + 1], aux[0, a - 1 : a])
        assert proposer.kv is not None and proposer.kv[0][0].shape[1] == min(a, WINDOW - 1)
        logits = proposer.block_logits([row[a]] + [cfg.mask_token_id] * (BLOCK - 1))
        torch.testing.assert_close(logits, trained[a - 1], rtol=1e-9, atol=1e-9, msg=f"anchor {a}")


def test_a_window_below_two_is_refused():
    with pytest.raises(UsageError, match="sliding_window"):
        small_config(sliding_window=1)


# ------------------------------------------------------------------------------------------------ export, vLLM

RESOLVE = """
import json, sys
from transformers import AutoConfig
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention, dflash_has_any_non_causal
out = {}
for folder in sys.argv[1:]:
    config = AutoConfig.from_pretrained(folder)
    out[folder] = [[list(_resolve_layer_attention(config, i)) for i in range(config.num_hidden_layers)],
                   dflash_has_any_non_causal(config)]
print(json.dumps(out))
"""


def test_export_carries_the_window_as_vllm_reads_it(tmp_path, vllm_python):
    """vLLM 0.32's own reading of the exported config.json: every layer windowed and causal with the window, or
    full and non-causal without one; eaglekit reads the window back from either file."""
    windowed, plain = tmp_path / "windowed", tmp_path / "plain"
    save_dflash(random_drafter(small_config(sliding_window=WINDOW)).float(), windowed)
    save_dflash(random_drafter(small_config()).float(), plain)
    probe = subprocess.run(
        [str(vllm_python), "-c", RESOLVE, str(windowed), str(plain)], capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert got[str(windowed)] == [[[WINDOW, True]] * 2, False]  # (per_layer_sliding_window, causal); all causal
    assert got[str(plain)] == [[[None, False]] * 2, True]

    assert read_dflash_config(windowed).sliding_window == WINDOW
    (windowed / "eaglekit.json").unlink()  # vLLM's config.json alone says it too
    assert read_dflash_config(windowed).sliding_window == WINDOW
    assert read_dflash_config(plain).sliding_window is None
    embed, head = torch.randn(40, 16), torch.randn(40, 16)
    assert load_dflash(windowed, embed, head).config.sliding_window == WINDOW
    spark = DSparkConfig(**small_config(sliding_window=WINDOW).to_dict(), markov_rank=4)  # DFlash's backbone form
    save_dspark(random_drafter(spark).float(), tmp_path / "dspark")
    (tmp_path / "dspark" / "eaglekit.json").unlink()
    assert json.loads((tmp_path / "dspark" / "config.json").read_text())["layer_types"] == ["sliding_attention"] * 2
    assert read_dspark_config(tmp_path / "dspark").sliding_window == WINDOW


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "mixes sliding and full layers"),
        ({"use_sliding_window": False}, "no window"),
        ({"dflash_config": {"mask_token_id": 39, "target_layer_ids": [0, 1, 2], "causal": False}}, "non-causal"),
    ],
)
def test_a_window_pattern_eaglekit_does_not_train_is_refused_by_name(tmp_path, edit, named):
    save_dflash(random_drafter(small_config(sliding_window=WINDOW)).float(), tmp_path)
    (tmp_path / "eaglekit.json").unlink()
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | edit))
    with pytest.raises(UsageError, match=named) as err:
        read_dflash_config(tmp_path)
    assert "config.json" in err.value.message


KERNEL = """
import sys, torch
import vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
torch.manual_seed(0)
heads, kv_heads, d, block, seq, queries, window = 2, 1, 32, 16, 40, 5, 8
isa = _get_attn_isa(torch.float32, block, d)
blocks = seq // block + 1
key_cache, value_cache = torch.zeros(blocks, kv_heads, block, d), torch.zeros(blocks, kv_heads, block, d)
k, v, q = torch.randn(seq, kv_heads, d), torch.randn(seq, kv_heads, d), torch.randn(queries, heads, d)
ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(seq), isa)
starts, lens = torch.tensor([0, queries], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32)
meta = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, d, lens, torch.float32, starts, True, window, isa, False)
out = torch.zeros(queries, heads, d)
ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, starts, lens, d**-0.5, True, None, window,
                                torch.arange(blocks, dtype=torch.int32)[None], 0.0, meta, None)
torch.save({"q": q, "k": k, "v": v, "out": out, "window": window}, sys.argv[1])
"""


def test_vllms_cpu_kernel_applies_the_window_eaglekit_trains(tmp_path, vllm_python):
    """vLLM's CPU attention with a sliding window on a causal query block (how it serves a sliding DFlash layer)
    equals attention under ``window_mask``: the last 5 of 40 positions query, each seeing p - 8 < k <= p."""
    from eaglekit.drafters.dflash.model import window_mask

    probe = subprocess.run(
        [str(vllm_python), "-c", KERNEL, str(tmp_path / "kernel.pt")], capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    r = torch.load(tmp_path / "kernel.pt")
    seq, queries = r["k"].shape[0], r["q"].shape[0]
    mask = window_mask(torch.arange(seq - queries, seq)[None], torch.arange(seq)[None], r["window"])[0]
    keys, values = r["k"][:, 0], r["v"][:, 0]
    scores = (r["q"] @ keys.T * r["q"].shape[-1] ** -0.5).masked_fill(~mask[:, None], float("-inf"))
    torch.testing.assert_close(r["out"], scores.softmax(-1) @ values, rtol=1e-4, atol=1e-5)
    assert mask.sum(-1).tolist() == [8] * 5  # the window does cut the 35 earlier keys down


# ------------------------------------------------------------------------------ trained on the tiny target

SERVED_WINDOW = 16


@pytest.fixture(scope="module")
def target(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target).eval(), AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def windowed(target):
    """A 2-layer, block-4 DFlash drafter with a 16-position window trained 120 steps (seed 0) on the tiny corpus
    (rows of ~100-300 tokens, so the window bites); one k_norm, which vLLM's CPU build serves exactly."""
    model, tok = target
    torch.manual_seed(0)
    aux = default_aux_layers(model.config.num_hidden_layers)
    mask_id = default_mask_token_id(tok, model.config.vocab_size)
    cfg = DFlashConfig.from_target_config(
        model.config, aux, mask_id, num_hidden_layers=2, block_size=BLOCK, shared_k_norm=True,
        sliding_window=SERVED_WINDOW,
    )  # fmt: skip
    drafter, taus, _ = train_block_drafter(model, tok, DFlashDrafter(cfg))
    return drafter, taus


def test_a_windowed_drafter_trains_and_decodes_losslessly(target, windowed):
    model, tok = target
    drafter, taus = windowed
    first, last = sum(taus[:10]) / 10, sum(taus[-10:]) / 10
    assert first < 1.3 and last > first + 1.0, (first, last)
    total = None
    for prompt in heldout_prompts(tok, 4):
        spec = generate(model, prompt, 48, proposer=BlockProposer(drafter), k=3)
        assert spec.tokens == generate(model, prompt, 48).tokens
        total = spec.stats if total is None else total + spec.stats
    assert total is not None and total.tau > 2.0, total.tau
    cached, logits, _ = one_round_two_ways(model, drafter, BlockProposer(drafter), heldout_prompts(tok, 1)[0], 3, 3)
    assert cached == logits[1:].argmax(-1).tolist()


@pytest.mark.slow
def test_vllm_serves_a_windowed_dflash_drafter_at_its_offline_acceptance(tmp_path, tiny_target, vllm_python, windowed):
    """The trained windowed drafter exported and served by vLLM's CPU build: served τ and every verify pass equal
    eaglekit's windowed offline decoding, which differs from the same weights decoded without the window."""
    from eaglekit import pipeline
    from eaglekit.config import load_config
    from eaglekit.rundir import RunDir
    from eaglekit.tiny import write_prompts

    drafter, _ = windowed
    save_dflash(drafter, tmp_path / "checkpoint")
    prompts = write_prompts(tmp_path / "heldout.jsonl", 8, seed=77)
    config = write_config(
        tmp_path / "config.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(tiny_target)},
            "data": {"prompts": str(prompts)},
            "evaluate": {
                "checkpoint": str(tmp_path / "checkpoint"),
                "prompts": str(prompts),
                "num_samples": 8,
                "max_new_tokens": 96,
            },  # fmt: skip
            "export": {"num_speculative_tokens": 3},
            "verify": {"engine": "vllm", "python": str(vllm_python)},
        },
    )
    cfg = load_config(config)
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "export", skip_preflight=True)
        exported = json.loads((tmp_path / "run" / "export" / "dflash" / "config.json").read_text())
        assert exported["layer_types"] == ["sliding_attention"] * 2 and exported["sliding_window"] == SERVED_WINDOW
        pipeline.run_stage(cfg, "verify", skip_preflight=True)
    report = json.loads((tmp_path / "run" / "verify" / "report.json").read_text())
    (r,) = report["runs"]
    print(f"windowed dflash: tau served {r['tau']['served']} offline {r['tau']['offline']}; rounds {r['rounds']}")
    assert report["verdict"] == "PASS", report
    assert r["tau"]["served"] == r["tau"]["offline"]
    assert r["rounds"] and r["rounds"]["compared"] == r["rounds"]["identical"] > 0

    full = DFlashDrafter(DFlashConfig(**(drafter.config.to_dict() | {"sliding_window": None})))
    full.load_state_dict(drafter.state_dict())
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    rounds = {
        name: [generate(model, p, 96, proposer=BlockProposer(d.eval()), k=3).stats.tau for p in heldout_prompts(tok, 4)]
        for name, d in (("windowed", drafter), ("full", full))
    }
    print(rounds)
    assert rounds["windowed"] != rounds["full"], "the window changes what the drafter sees: it drafts otherwise"


@pytest.mark.parametrize("architecture", ["dflash", "dspark"])
def test_train_draft_sliding_window_builds_a_windowed_block_drafter(tiny_target, architecture):
    """The run config's key reaches the drafter train builds (and plan and pre-flight size)."""
    from eaglekit.config import parse_config
    from eaglekit.demo import demo_config
    from eaglekit.drafters.registry import fresh_drafter_config

    raw = demo_config(tiny_target)
    raw["train"]["draft"] = {"architecture": architecture, "sliding_window": 64, "mask_token_id": 0}
    cfg = fresh_drafter_config(parse_config(raw))
    assert isinstance(cfg, DSparkConfig if architecture == "dspark" else DFlashConfig) and cfg.sliding_window == 64

"""Several draft decoder layers (train.draft.num_layers) for EAGLE-3's Llama drafter and P-EAGLE: the forward is
vLLM 0.32's (llama_eagle3.py, on the same weights, in vLLM's own code), every TTT step is the cached forward of its
chain through every layer, TTT trains them, both forms read back, a published multi-layer checkpoint loads for
finetuning, offline decoding stays lossless with one KV cache per layer, sizing and memory grow with the layers, and
`train` -> `evaluate` -> `export` run with two layers for both families. One layer is the drafter as before (the
other tests of tests/drafters/ hold it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.helpers import run_in_vllm
from test_drafter_ttt import make_batch, make_drafter, tiny_config
from test_extract import prepared_run
from test_peagle import served_logits, small_config, small_drafter
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from eaglekit.config import TTTConfig, parse_config
from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3.family import same_logits
from eaglekit.drafters.eagle3.fused import StepKernels
from eaglekit.drafters.eagle3.llama import EAGLE3_LLAMA
from eaglekit.drafters.eagle3.memory import step_memory
from eaglekit.drafters.eagle3.model import DrafterConfig, DraftKVCache, Eagle3Drafter
from eaglekit.drafters.eagle3.proposer import EagleProposer
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.drafters.peagle import checkpoint as peagle_checkpoint
from eaglekit.errors import UsageError
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.pipeline import run_stage
from eaglekit.rundir import RunDir
from eaglekit.speculative.decode import generate
from eaglekit.tiny.corpus import sample_tasks

EAGLE31 = dict(fc_norm=True, norm_output=True)


def two_layers(**kw) -> DrafterConfig:
    return tiny_config(num_layers=2, **{**EAGLE31, **kw})


# ------------------------------------------------------------------------------------------ vLLM's forward

# vLLM's own config reading and model code on the CPU: the config vLLM builds from each exported folder, the
# Eagle3LlamaForCausalLM it constructs from it (``layers.0`` reading 2H, ``layers.1`` H), every weight its loader puts
# in, and its forward (fused add + RMSNorm between the layers, the final norm, norm_output). Only the attention
# kernel needs the engine's batch metadata, so each layer's ``attn`` is a causal softmax attention over the q, k, v
# vLLM's own qkv_proj and rotary embedding made.
VLLM_FORWARD = """
import json, sys, torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

target, port, io, *folders = sys.argv[1:]
given, out = torch.load(io + "/in.pt"), {}


def causal(attn, q, k, v):
    q, k, v = (x.view(x.shape[0], -1, attn.head_size).transpose(0, 1) for x in (q, k, v))
    groups = attn.num_heads // attn.num_kv_heads
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), is_causal=True, scale=attn.impl.scale
    )
    return o.transpose(0, 1).reshape(q.shape[1], -1)


for n, draft in enumerate(folders):
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
    args = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256, speculative_config=spec)
    cfg = args.create_engine_config()
    with set_current_vllm_config(cfg):
        if n == 0:
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:" + port, backend="gloo"
            )
            initialize_model_parallel(1, 1)
        model = Eagle3LlamaForCausalLM(vllm_config=cfg, prefix=f"draft{n}")
        model.load_weights(load_file(draft + "/model.safetensors").items())
        process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
        for layer in model.model.layers:
            layer.self_attn.attn.forward = lambda q, k, v, *_, a=layer.self_attn.attn, **__: causal(a, q, k, v)
        with torch.no_grad():
            normed, feature = model(given["ids"], given["positions"], model.combine_hidden_states(given["aux"]))
            logits = normed @ model.lm_head.weight.T
    hf = cfg.speculative_config.draft_model_config.hf_config
    out[draft] = {
        "logits": logits,
        "feature": feature,
        "num_hidden_layers": hf.num_hidden_layers,
        "qkv_input": [layer.self_attn.qkv_proj.input_size for layer in model.model.layers],
        "architectures": hf.architectures,
    }
torch.save(out, io + "/out.pt")
"""


def test_two_layers_compute_what_vllm_computes_on_the_same_weights(tmp_path, tiny_target, vllm_python):
    from eaglekit.serving.engine import free_port

    hf = AutoConfig.from_pretrained(tiny_target)
    cfg = DrafterConfig.from_target_config(hf, 64, None, num_layers=2, norm_before_residual=True, **EAGLE31)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():  # norms away from 1, so a norm read from the wrong key shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    plain, spec = tmp_path / "eagle3", tmp_path / "speculators"
    eagle3_checkpoint.save_legacy(drafter, plain)
    eagle3_checkpoint.save_speculators(drafter, spec, str(tiny_target), ["LlamaForCausalLM"], 3)
    g = torch.Generator().manual_seed(1)
    ids, aux = (
        torch.randint(0, cfg.vocab_size, (12,), generator=g),
        torch.randn(12, 3 * cfg.target_hidden_size, generator=g),
    )
    torch.save({"ids": ids, "aux": aux, "positions": torch.arange(12)}, tmp_path / "in.pt")
    run_in_vllm(vllm_python, VLLM_FORWARD, tiny_target, free_port(), tmp_path, plain, spec, cwd=tmp_path)
    served = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        logits, feature = drafter(ids[None], drafter.fuse(aux[None]), torch.arange(12)[None])
    for folder, architecture in ((plain, "LlamaForCausalLMEagle3"), (spec, "Eagle3LlamaForCausalLM")):
        got = served[str(folder)]
        assert got["num_hidden_layers"] == 2 and got["architectures"] == [architecture]
        assert got["qkv_input"] == [2 * cfg.hidden_size, cfg.hidden_size]
        torch.testing.assert_close(got["logits"], logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["feature"], feature[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ training-time test


def cached_chain_losses(drafter, aux, ids, target_logits, steps):
    """Each TTT step as decoding runs it, through the drafter's forward and one KV cache per layer: chain t reads
    positions 0..t with their target features, then feeds its own feature back at t+1, t+2, ... with the next
    ground-truth token. Per step: the soft cross-entropy of every chain whose target exists."""
    length = ids.shape[1]
    feature = drafter.fuse(aux)
    tokens = F.pad(ids[:, 1:], (0, 1))
    want = [[] for _ in range(steps)]
    for t in range(length - 2):
        cache = DraftKVCache()
        logits, hidden = drafter(tokens[:, : t + 1], feature[:, : t + 1], torch.arange(t + 1)[None], cache)
        logits, hidden = logits[:, -1:], hidden[:, -1:]
        for k in range(min(steps, length - 2 - t)):
            if k:
                token = ids[:, t + 1 + k : t + 2 + k]
                logits, hidden = drafter(token, hidden, torch.tensor([[t + k]]), cache)
            p = torch.softmax(target_logits[0, t + 1 + k], -1)
            want[k].append(float(-(p * F.log_softmax(logits[0, -1], -1)).sum()))
    return want


@pytest.mark.parametrize("window", [None, 5])
def test_every_ttt_step_is_the_cached_forward_of_its_chain(window):
    """With two layers each step runs both, and each layer attends its own step-0 keys and its own keys of the
    chain's earlier steps: TTT's loss at every step is the cached decoding forward's."""
    cfg = two_layers(sliding_window=window, norm_before_residual=True)
    drafter = make_drafter(cfg)
    aux, ids, target_logits, *_ = make_batch(cfg, b=1, length=11, pad=False)
    steps = 4
    with torch.no_grad():
        figures = ttt_loss(drafter, aux, ids, target_logits, torch.ones_like(ids), settings=TTTConfig(steps=steps))
        want = cached_chain_losses(drafter, aux, ids, target_logits, steps)
    assert figures.count_k == [len(w) for w in want]
    for k in range(steps):
        assert figures.loss_k[k] == pytest.approx(sum(want[k]) / len(want[k]), rel=1e-9)


def test_a_two_layer_parallel_drafter_trains_what_vllm_serves_at_every_depth():
    """P-EAGLE with two layers: each slot's loss is the logits of the one forward vLLM runs over the verified
    positions and the slots (test_peagle.served_logits), through both layers."""
    cfg = small_config(num_layers=2)
    drafter = small_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    length, steps = 12, 3
    aux = torch.randn(1, length, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=g)
    target_logits = 3 * torch.randn(1, length, cfg.draft_vocab_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        figures = ttt_loss(drafter, aux, ids, target_logits, torch.ones_like(ids), settings=TTTConfig(steps=steps))
        want = [[] for _ in range(steps)]
        for anchor in range(length - 2):
            logits = served_logits(drafter, aux[0], ids[0], anchor, steps)
            for d in range(min(steps, length - 2 - anchor)):
                p = torch.softmax(target_logits[0, anchor + 1 + d], -1)
                want[d].append(float(-(p * F.log_softmax(logits[d], -1)).sum()))
    for d in range(steps):
        assert figures.loss_k[d] == pytest.approx(sum(want[d]) / len(want[d]), rel=1e-9)


@pytest.mark.parametrize("family", ["llama", "peagle"])
def test_ttt_trains_every_layer(family):
    """Fixed seed, one batch, AdamW: the loss falls, and every layer (and P-EAGLE's mask_hidden) gets a gradient."""
    if family == "peagle":
        drafter = small_drafter(small_config(num_layers=2)).float()
    else:
        drafter = make_drafter(two_layers(), dtype=torch.float32)
    aux, ids, target_logits, loss_mask, *_ = make_batch(drafter.config, b=2, length=16, dtype=torch.float32, pad=False)
    drafter.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(25):
        out = ttt_loss(drafter, aux, ids, target_logits, loss_mask, settings=TTTConfig(steps=3))
        optimizer.zero_grad()
        out.loss.backward()
        if step == 0:
            for name, p in drafter.named_parameters():
                if p.requires_grad and name.startswith(("midlayer.", "upper_layers.", "mask_hidden")):
                    assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_step_kernels_and_recomputation_give_the_reference_with_two_layers():
    """Unpacked step 0 through scaled_dot_product_attention, and every step's layers recomputed in backward
    (train.ttt.activation_checkpointing): the reference loss and gradients of both layers."""
    drafter = make_drafter(two_layers())
    aux, ids, target_logits, loss_mask, attention_mask, in_draft = make_batch(drafter.config, b=2, length=12)

    def run(kernels: StepKernels):
        drafter.zero_grad()
        out = ttt_loss(
            drafter, aux, ids, target_logits, loss_mask, attention_mask, target_in_draft=in_draft,
            settings=TTTConfig(steps=3), kernels=kernels,
        )  # fmt: skip
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    want, want_grads = run(StepKernels())
    for kernels in (StepKernels(attention="sdpa"), StepKernels(checkpoint_steps=True)):
        loss, grads = run(kernels)
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
        assert grads.keys() == want_grads.keys() and any(n.startswith("upper_layers.") for n in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-8, atol=1e-10, msg=name)


# ------------------------------------------------------------------------------------------ forms on disk


def randomised(drafter):
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("family", ["llama", "peagle"])
def test_both_forms_read_back_with_every_layer(tmp_path, family):
    """Both forms name every layer ``layers.{i}.`` and num_hidden_layers 2; the plain form, which SGLang loads, also
    carries layer 1's input norm as its hidden_norm (SGLang norms layers >= 1 with it, vLLM with input_layernorm);
    each reads back as the same drafter, logit for logit (export's own read-back check)."""
    if family == "peagle":
        drafter, io = randomised(small_drafter(small_config(num_layers=2)).float()), peagle_checkpoint
        extra = ("mask_hidden",)
    else:
        drafter, io, extra = randomised(make_drafter(two_layers(), dtype=torch.float32)), eagle3_checkpoint, ()
    plain, spec = tmp_path / "eagle3", tmp_path / "speculators"
    io.save_legacy(drafter, plain)
    io.save_speculators(drafter, spec, "target", ["LlamaForCausalLM"], 3)
    for folder, layer_config in ((plain, lambda c: c), (spec, lambda c: c["transformer_layer_config"])):
        config = json.loads((folder / "config.json").read_text())
        assert layer_config(config)["num_hidden_layers"] == 2
        keys = set(load_file(str(folder / "model.safetensors")))
        assert not any(k.startswith(("midlayer.", "upper_layers.")) for k in keys)
        assert {"layers.0.hidden_norm.weight", "layers.1.self_attn.q_proj.weight", *extra} <= keys
        again, info = io.load_drafter(folder)
        assert again.config == drafter.config and again.config.num_layers == 2
        state = again.state_dict()
        assert state.keys() == drafter.state_dict().keys()
        for key, value in drafter.state_dict().items():
            assert torch.equal(state[key], value), key
    state = load_file(str(plain / "model.safetensors"))
    assert torch.equal(state["layers.1.hidden_norm.weight"], state["layers.1.input_layernorm.weight"])
    assert "layers.1.hidden_norm.weight" not in load_file(str(spec / "model.safetensors"))
    assert drafter.upper_layers[0].self_attn.q_proj.weight.shape[1] == drafter.config.hidden_size
    if family == "llama":
        for folder in (plain, spec):
            same_logits(drafter, folder)
        # one layer: the plain form as before, ``midlayer.`` and num_hidden_layers 1
        eagle3_checkpoint.save_legacy(make_drafter(tiny_config(**EAGLE31), dtype=torch.float32), tmp_path / "one")
        one = set(load_file(str(tmp_path / "one" / "model.safetensors")))
        assert "midlayer.self_attn.q_proj.weight" in one and not any(k.startswith("layers.") for k in one)
        assert json.loads((tmp_path / "one" / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_published_multi_layer_drafter_loads_for_finetuning(tmp_path):
    """A peer's three-layer EAGLE-3 drafter (speculators' ``layers.N.`` keys, no hidden_norm above layer 0, bf16, no
    embedding, an optimizer state beside it) loads with every layer, in the plain form and in speculators'."""
    drafter = randomised(make_drafter(tiny_config(num_layers=3, **EAGLE31), dtype=torch.float32))
    eagle3_checkpoint.save_speculators(drafter, tmp_path / "spec", "org/target", ["LlamaForCausalLM"], 3)
    published = tmp_path / "published"
    published.mkdir()
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    plain = {"architectures": ["LlamaForCausalLMEagle3"], **raw["transformer_layer_config"]}
    plain |= {key: raw[key] for key in ("draft_vocab_size", "target_hidden_size", "fc_norm", "norm_output")}
    (published / "config.json").write_text(json.dumps(plain))
    state = load_file(str(tmp_path / "spec" / "model.safetensors"))
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    state.pop("embed_tokens.weight")
    save_file(state, str(published / "model.safetensors"))
    torch.save({"optimizer": {}}, published / "training_state.pt")
    for folder in (published, tmp_path / "spec"):
        loaded, info = eagle3_checkpoint.load_drafter(folder)
        assert loaded.config.num_layers == 3 and len(loaded.upper_layers) == 2
        want = drafter.upper_layers[1].mlp.down_proj.weight
        assert torch.equal(loaded.upper_layers[1].mlp.down_proj.weight.float(), want.to(loaded.fc.weight.dtype).float())
    assert info.form == "speculators" and not info.missing_embeddings


def test_preflight_says_a_finetune_keeps_its_checkpoints_layers(tmp_path, tiny_target):
    """train.init_from a two-layer drafter: its layers are what trains; a train.draft.num_layers that differs is named."""
    hf = AutoConfig.from_pretrained(tiny_target)
    eagle3_checkpoint.save_legacy(
        Eagle3Drafter(DrafterConfig.from_target_config(hf, 64, None, num_layers=2)), tmp_path / "d"
    )
    base = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "p.jsonl"}}
    for asked, status in ((None, "ok"), (2, "ok"), (1, "warn")):
        train = {"init_from": str(tmp_path / "d"), "draft": {"num_layers": asked}}
        cfg = parse_config(base | {"train": train}, base_dir=tmp_path)
        verdict = EAGLE3_LLAMA.diagnosis.finetune_check(cfg, tmp_path / "d", str(tmp_path / "d"))
        assert verdict.level == status, verdict
    assert "it has 2 decoder layer(s), train.draft.num_layers 1 does not apply to a finetune" in verdict.detail


def test_an_mla_drafter_with_several_layers_is_refused_by_name(tmp_path):
    with pytest.raises(UsageError, match="num_layers 2: eaglekit builds an mla drafter with one decoder layer"):
        tiny_config(
            num_layers=2, architecture="mla", num_key_value_heads=None, head_dim=None, q_lora_rank=12,
            kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        )  # fmt: skip
    base = {"run_dir": "run", "target": {"model": "t"}, "data": {"prompts": "p.jsonl"}}
    with pytest.raises(UsageError, match=r"architecture mla does not read num_layers \(peagle, llama,"):
        parse_config(base | {"train": {"draft": {"architecture": "mla", "num_layers": 2}}}, base_dir=tmp_path)
    for family in ("llama", "peagle"):
        cfg = parse_config(base | {"train": {"draft": {"architecture": family, "num_layers": 4}}}, base_dir=tmp_path)
        assert cfg.train.draft.num_layers == 4


# ------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_decoding_with_two_layers_is_lossless_and_each_layers_cache_holds(target):
    """At T=0 speculative decoding emits the target's greedy tokens; every round's drafts are what the drafter
    predicts from scratch over the sequence so far (so each layer's KV cache, cropped after rejections, holds)."""
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=64, num_layers=2, **EAGLE31)
    drafter = Eagle3Drafter(cfg).eval()
    d2t, t2d = build_d2t_t2d(torch.randperm(96)[:64].sort().values, 96)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)

    class Checked(EagleProposer):
        def reset(self, ids, aux):
            super().reset(ids, aux)
            self.rounds, self.seq = [], list(ids)

        def propose(self, k, temperature, generator):
            drafts, q = super().propose(k, temperature, generator)
            self.rounds.append((list(self.seq), drafts))
            return drafts, q

        def update(self, new_ids, aux):
            self.seq += new_ids
            super().update(new_ids, aux)

    g = torch.Generator().manual_seed(123)
    prompt = torch.randint(0, 96, (10,), generator=g).tolist()
    plain = generate(target, prompt, 30)
    for k in (1, 3):
        proposer = Checked(drafter)
        assert generate(target, prompt, 30, proposer=proposer, k=k).tokens == plain.tokens
    assert len(proposer.rounds) >= 5 and len(proposer.cache.upper) == 1
    with torch.no_grad():
        for seq, drafts in proposer.rounds:
            hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in proposer.aux_layer_ids], -1)[:, :-1]
            ids, hidden = torch.tensor([seq[1:]]), drafter.fuse(aux)
            expected = []
            for _ in drafts:
                logits, out = drafter(ids, hidden, torch.arange(ids.shape[1])[None])
                expected.append(int(drafter.draft_to_target(logits[0, -1].argmax())))
                ids = torch.cat([ids, torch.tensor([[expected[-1]]])], 1)
                hidden = torch.cat([hidden, out[:, -1:]], 1)
            assert drafts == expected


# ------------------------------------------------------------------------------------------ sizing and memory


def test_parameters_and_step_memory_grow_with_the_layers():
    one, two = tiny_config(**EAGLE31), two_layers()
    upper = sum(p.numel() for p in Eagle3Drafter(two).upper_layers.parameters())
    assert EAGLE3_LLAMA.sizing.parameter_counts(two)[1] - EAGLE3_LLAMA.sizing.parameter_counts(one)[1] == upper
    sizes = {"trainable": 10_000, "frozen": 1_000}
    for checkpoint in (False, True):
        m1 = step_memory(one, 256, 3, checkpoint=checkpoint, bf16=False, **sizes)
        m2 = step_memory(two, 256, 3, checkpoint=checkpoint, bf16=False, **sizes)
        # plain, each layer keeps its own activations; checkpointed, each step keeps its input and output (one of
        # each whatever the layers) and each layer's keys, and recomputes one step of every layer in backward
        assert m2.activations > (1.1 if checkpoint else 1.5) * m1.activations, (checkpoint, m1, m2)
        assert m2.transient >= m1.transient
    shared = {"checkpoint": False, "bf16": False, "context_parallel": 2, **sizes}
    m1, m2 = step_memory(one, 256, 3, **shared), step_memory(two, 256, 3, **shared)
    assert m2.gathered == 2 * m1.gathered  # each layer's step-0 keys and values of the other rank


# ------------------------------------------------------------------------------------------ the stages


@pytest.mark.parametrize("family", ["llama", "peagle"])
def test_train_evaluate_and_export_a_two_layer_drafter(tmp_path, tiny_target, family):
    """train.draft.num_layers 2 through the stages: six TTT steps, the checkpoint holds two layers, offline
    decoding at T=0 is lossless, export writes both forms (each read back logit for logit) and the card says so."""
    train = {"max_steps": 6, "log_every": 2, "eval_every": 6, "save_every": 6, "seed": 0, "ttt": {"steps": 3}}
    cfg = prepared_run(tmp_path, tiny_target, n=24, train=train | {"draft": {"architecture": family, "num_layers": 2}})
    prompts = tmp_path / "heldout.jsonl"
    tasks = sample_tasks(3, seed=99, split="heldout")
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t.prompt}]}) + "\n"
            for i, t in enumerate(tasks)
        )
    )
    cfg.evaluate.prompts, cfg.evaluate.num_samples = str(prompts), 3
    cfg.evaluate.num_speculative_tokens, cfg.evaluate.temperatures, cfg.evaluate.max_new_tokens = [3], [0.0], 24
    with RunDir(cfg.run_dir).lock:
        trained = run_stage(cfg, "train", skip_preflight=True)
        run_stage(cfg, "evaluate", skip_preflight=True)
        run_stage(cfg, "export", skip_preflight=True)
    assert trained["counts"]["steps"] == 6
    run = Path(cfg.run_dir)
    best = json.loads((run / "train" / "checkpoints" / "best" / "config.json").read_text())
    assert best["num_hidden_layers"] == 2
    report = json.loads((run / "evaluate" / "report.json").read_text())
    assert report["lossless"]
    for form in ("eagle3", "speculators"):
        raw = json.loads((run / "export" / form / "config.json").read_text())
        assert (raw.get("transformer_layer_config") or raw)["num_hidden_layers"] == 2
    assert "2 decoder layers" in (run / "export" / "README.md").read_text()


def test_drafter_config_dict_round_trips_the_layer_count():
    cfg = two_layers()
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg, num_layers=1) == tiny_config(**EAGLE31)

"""P-EAGLE (drafters/peagle/): what it trains is what vLLM 0.32 computes when it serves it, its proposer drafts what
one forward drafts, its forms are the ones vLLM reads, and `eaglekit run` trains, evaluates, exports and serves it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from eaglekit.config import TTTConfig
from eaglekit.drafters.eagle3.ttt import ttt_loss
from eaglekit.drafters.peagle import checkpoint as peagle_checkpoint
from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter
from eaglekit.drafters.peagle.proposer import ParallelProposer
from eaglekit.errors import EaglekitError
from eaglekit.model.draft_vocab import build_d2t_t2d

SLOT = 3


def small_config(**kw) -> PEagleConfig:
    base = dict(
        hidden_size=32, intermediate_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128, vocab_size=39,
        draft_vocab_size=11, target_hidden_size=24, aux_layer_ids=[2, 3, 5], fc_norm=True, mask_token_id=SLOT,
    )  # fmt: skip
    base.update(kw)
    return PEagleConfig(**base)


def small_drafter(cfg: PEagleConfig, seed: int = 0) -> PEagleDrafter:
    torch.manual_seed(seed)
    drafter = PEagleDrafter(cfg).double()
    d2t, t2d = build_d2t_t2d(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values, cfg.vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter


def served_logits(drafter: PEagleDrafter, aux: torch.Tensor, ids: torch.Tensor, anchor: int, depths: int):
    """What vLLM's proposer computes for the round whose last verified position is ``anchor``: positions 0..anchor
    with their target states and next tokens, then depths-1 slots, one causal forward, no cache; logits [depths, Vd]."""
    slots = depths - 1
    hidden = torch.cat([drafter.fuse(aux[: anchor + 1]), drafter.slot_feature(slots)]).unsqueeze(0)
    tokens = torch.cat([ids[1 : anchor + 2], drafter.slot_ids(slots, ids.device)]).unsqueeze(0)
    logits, _ = drafter(tokens, hidden, torch.arange(anchor + 1 + slots)[None])
    return logits[0, anchor:]


@pytest.mark.parametrize("window", [None, 9])
def test_training_is_the_served_forward_at_every_depth(window):
    """The objective's loss at depth d is the soft cross-entropy of the logits vLLM computes at slot d (one forward
    over the verified positions and the slots) against the target at that position, for every chain."""
    cfg = small_config(sliding_window=window)
    drafter = small_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    length, steps = 14, 4
    aux = torch.randn(1, length, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=g)
    target_logits = 3 * torch.randn(1, length, cfg.draft_vocab_size, generator=g, dtype=torch.float64)
    loss_mask = torch.ones(1, length, dtype=torch.long)
    figures = ttt_loss(drafter, aux, ids, target_logits, loss_mask, settings=TTTConfig(steps=steps))
    want = [[] for _ in range(steps)]
    for anchor in range(length - 2):  # chain t: token t+2+d exists
        logits = served_logits(drafter, aux[0], ids[0], anchor, steps)
        for d in range(min(steps, length - 2 - anchor)):
            p = torch.softmax(target_logits[0, anchor + 1 + d], -1)
            want[d].append(float(-(p * F.log_softmax(logits[d].detach(), -1)).sum()))
    assert figures.count_k == [len(w) for w in want]
    for d in range(steps):
        assert figures.loss_k[d] == pytest.approx(sum(want[d]) / len(want[d]), rel=1e-9, abs=1e-12)


def test_mask_hidden_trains():
    cfg = small_config()
    drafter = small_drafter(cfg)
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(1, 10, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=g)
    target = torch.randn(1, 10, cfg.draft_vocab_size, generator=g, dtype=torch.float64)
    out = ttt_loss(drafter, aux, ids, target, torch.ones(1, 10, dtype=torch.long), settings=TTTConfig(steps=3))
    out.loss.backward()
    assert drafter.mask_hidden.grad is not None and drafter.mask_hidden.grad.abs().sum() > 0


def test_proposer_drafts_what_one_uncached_forward_drafts():
    """Round after round (its KV cache cropped back to the verified positions), the proposer's K drafts are the
    argmaxes of the served forward over the whole sequence so far."""
    cfg = small_config()
    drafter = small_drafter(cfg).float()
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(30, 3 * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (31,), generator=g)
    proposer = ParallelProposer(drafter, cfg.aux_layer_ids)
    proposer.reset(ids[:6].tolist(), aux[:5])
    seen, k = 5, 4
    for step in (3, 1, 5, 2):
        drafts, q = proposer.propose(k, 0.0, None)
        assert q is None
        logits = served_logits(drafter, aux, ids, seen - 1, k)
        assert drafts == [int(drafter.d2t[i] + i) for i in logits.argmax(-1).tolist()]
        proposer.update(ids[seen + 1 : seen + 1 + step].tolist(), aux[seen : seen + step])
        seen += step


# ------------------------------------------------------------------------------------------------ forms


def test_both_forms_read_back_and_vllm_reads_them_as_trained(tmp_path, vllm_python):
    cfg = small_config(vocab_size=514, draft_vocab_size=100)
    drafter = small_drafter(cfg).float()
    plain, spec = tmp_path / "eagle3", tmp_path / "speculators"
    peagle_checkpoint.save_legacy(drafter, plain)
    peagle_checkpoint.save_speculators(drafter, spec, "target", ["LlamaForCausalLM"], 5)
    for folder in (plain, spec):
        assert peagle_checkpoint.is_peagle_folder(folder)
        again, _ = peagle_checkpoint.load_drafter(folder)
        assert again.config == drafter.config
        assert torch.equal(again.mask_hidden, drafter.mask_hidden)
    # what vLLM's own readers make of them: the slot token, the flags, parallel drafting, the architecture
    probe = f"""
import json
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
raw = json.load(open({str(spec / "config.json")!r}))
layer = SpeculatorsConfig.extract_transformers_pre_trained_config(raw)
spec = SpeculatorsConfig.extract_vllm_speculative_config(raw)
from vllm.transformers_utils.configs.eagle import EAGLEConfig
from transformers import AutoConfig
plain = EAGLEConfig(AutoConfig.from_pretrained({str(plain)!r}), method="eagle3")
print(json.dumps(dict(spec=spec, pard=layer["pard_token"], fc_norm=layer.get("fc_norm"),
      arch=layer["architectures"], plain_arch=plain.architectures, plain_pard=plain.pard_token,
      plain_fc_norm=plain.fc_norm)))
"""
    out = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["spec"] == {"method": "eagle3", "num_speculative_tokens": 5, "parallel_drafting": True}
    assert read["pard"] == read["plain_pard"] == SLOT
    assert read["fc_norm"] is True and read["plain_fc_norm"] is True  # the layer config's, which vLLM keeps
    assert read["arch"] == ["PeagleLlamaForCausalLM"] and read["plain_arch"] == ["LlamaForCausalLMEagle3"]


def test_a_folder_that_lost_mask_hidden_is_refused_by_name(tmp_path):
    drafter = small_drafter(small_config()).float()
    peagle_checkpoint.save_legacy(drafter, tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if k != "mask_hidden"}, str(weights))
    with pytest.raises(EaglekitError, match="missing key mask_hidden"):
        peagle_checkpoint.load_drafter(tmp_path)


# ------------------------------------------------------------------------------------------- `eaglekit run`


def run_config(root: Path, target: Path, **verify) -> dict:
    """The demo's data and settings with a P-EAGLE drafter: 40 steps of 8 rows, 3 parallel slots trained;
    evaluate at K = 1 and 3; verify in the real vLLM CPU build when ``verify`` is given."""
    from eaglekit.demo import demo_config

    cfg = demo_config(target)
    cfg["data"]["prompts"] = str(root / "prompts.jsonl")
    cfg["run_dir"] = str(root / "run")
    cfg["train"].update(
        {"max_steps": 40, "batch_size": 8, "lr": 1e-3, "eval_every": 20, "save_every": 20, "ttt": {"steps": 3}}
    )
    cfg["train"]["draft"] = {"architecture": "peagle"}
    cfg["evaluate"].update({"num_speculative_tokens": [1, 3], "num_samples": 4})
    cfg["export"] = {"num_speculative_tokens": 3}
    cfg.pop("verify", None)
    if verify:
        cfg["verify"] = {"engine": "vllm", "num_samples": 4, **verify}
    return cfg


@pytest.fixture(scope="module")
def peagle_run(tmp_path_factory, tiny_target, vllm_python):
    """One `eaglekit run` of a P-EAGLE drafter: generate to verify, both forms served by vLLM's CPU build."""
    from eaglekit.tiny import write_prompts

    root = tmp_path_factory.mktemp("peagle-run")
    write_prompts(root / "prompts.jsonl", 120, seed=0)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(run_config(root, tiny_target, python=str(vllm_python))))
    proc = subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(path)], capture_output=True, text=True, timeout=2400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "run", proc.stdout + proc.stderr


@pytest.mark.slow
def test_run_trains_evaluates_and_exports_a_parallel_drafter(peagle_run):
    run_dir, _ = peagle_run
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    assert len(summary["acc_k"]) == 3  # every parallel slot trained is measured
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    assert report["lossless"]
    taus = {(r["method"], r["k"]): r["tau"] for r in report["results"] if r["temperature"] == 0}
    assert taus["eagle", 3] > taus["eagle", 1] > taus["ngram", 1]
    plain = json.loads((run_dir / "export" / "eagle3" / "config.json").read_text())
    assert plain["architectures"] == ["LlamaForCausalLMEagle3"] and plain["pard_token"] == 0
    spec = json.loads((run_dir / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "peagle" and spec["mask_token_id"] == 0
    card = (run_dir / "export" / "README.md").read_text()
    assert '"parallel_drafting":true' in card and "P-EAGLE" in card and "sglang.launch_server" not in card


@pytest.mark.slow
def test_verify_serves_both_forms_at_the_offline_acceptance(peagle_run):
    run_dir, out = peagle_run
    verify = json.loads((run_dir / "verify" / "report.json").read_text())
    assert verify["verdict"] == "PASS", verify
    assert sorted(r["form"] for r in verify["runs"]) == ["eagle3", "speculators"]
    for served in verify["runs"]:
        assert served["k"] == 3 and served["tau"]["served"] == served["tau"]["offline"] > 1.5
    plain = next(r for r in verify["runs"] if r["form"] == "eagle3")
    assert '"parallel_drafting": true' in plain["launch"]


def test_diagnosis_names_a_plain_form_served_without_parallel_drafting(tmp_path):
    """Served as a chain (no parallel_drafting in --speculative-config), or with another slot token than trained:
    each named as the suspect; served as trained, neither."""
    from eaglekit.drafters.diagnosis import ServedDrafter
    from eaglekit.drafters.peagle.diagnosis import parallel_drafting, slot_inputs

    drafter = small_drafter(small_config()).float()
    trained, served = tmp_path / "trained", tmp_path / "served"
    peagle_checkpoint.save_legacy(drafter, trained)
    peagle_checkpoint.save_legacy(drafter, served)
    spec = {"method": "eagle3", "model": str(served), "num_speculative_tokens": 3}

    def reading(launch: dict) -> ServedDrafter:
        runs = [{"launch": f"vllm serve target --speculative-config '{json.dumps(launch)}'"}]
        return ServedDrafter(None, served, "vllm", [2, 3, 5], trained, runs)  # type: ignore[arg-type]

    assert parallel_drafting(reading(spec))["status"] == "suspect"
    assert parallel_drafting(reading(spec | {"parallel_drafting": True}))["status"] == "ok"
    assert slot_inputs(reading(spec))["status"] == "ok"
    config = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps(config | {"pard_token": SLOT + 1}))
    row = slot_inputs(reading(spec))
    assert row["status"] == "suspect" and f"token {SLOT + 1}" in row["detail"]

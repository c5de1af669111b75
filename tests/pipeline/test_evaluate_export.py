"""evaluate and export on the tiny target: the report and plots, losslessness, the exported forms' round trip,
and refusal of checkpoints whose keys, shapes or serving settings are wrong."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from support.helpers import write_config

from eaglekit import pipeline
from eaglekit.config import TTTConfig, load_config
from eaglekit.drafters.eagle3.checkpoint import load_drafter, save_legacy
from eaglekit.errors import EaglekitError

pytestmark = pytest.mark.slow  # builds, trains or serves models


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory) -> Path:
    """A drafter trained for a few dozen TTT steps on the tiny target's own kind of text (full draft vocab)."""
    from transformers import AutoModelForCausalLM

    from eaglekit.data.chat import load_tokenizer, render_sample
    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.drafters.eagle3.ttt import ttt_loss
    from eaglekit.model.draft_vocab import build_d2t_t2d
    from eaglekit.model.target import TargetFeatures, default_aux_layers
    from eaglekit.tiny.corpus import sample_tasks

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = load_tokenizer(str(tiny_target))
    rows = [
        render_sample(tokenizer, [{"role": "user", "content": t.prompt}], t.reasoning, t.answer)
        for t in sample_tasks(32, seed=5, split="train")
    ]
    width = max(len(r.input_ids) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r.input_ids)] = torch.tensor(r.input_ids)
        mask[i, : len(r.loss_mask)] = torch.tensor(r.loss_mask)
        attention[i, : len(r.input_ids)] = 1
    vocab = target.config.vocab_size
    aux = default_aux_layers(target.config.num_hidden_layers)
    d2t, t2d = build_d2t_t2d(torch.arange(vocab), vocab)
    with torch.no_grad():
        feats = TargetFeatures(target, aux, t2d)(ids, attention)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(target.config, vocab, aux))
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    params = [p for n, p in drafter.named_parameters() if n != "embed_tokens.weight"]
    optim = torch.optim.AdamW(params, lr=3e-3)
    for step in range(40):
        batch = slice(8 * (step % 4), 8 * (step % 4) + 8)
        out = ttt_loss(
            drafter,
            feats.aux[batch],
            ids[batch],
            feats.target_logits[batch],
            mask[batch],
            attention[batch],
            settings=TTTConfig(steps=3),
            target_in_draft=feats.target_in_draft[batch],
        )
        out.loss.backward()
        optim.step()
        optim.zero_grad()
    path = tmp_path_factory.mktemp("drafter") / "best"
    save_legacy(drafter.eval(), path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    from eaglekit.tiny.corpus import sample_tasks

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t.prompt}]}) + "\n"
            for i, t in enumerate(sample_tasks(3, seed=99, split="heldout"))
        )
    )
    return path


def make_config(tmp_path: Path, tiny_target: Path, drafter: Path, prompts: Path, **export) -> Path:
    return write_config(
        tmp_path / "config.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(tiny_target)},
            "data": {"prompts": str(prompts)},
            "evaluate": {
                "prompts": str(prompts),
                "checkpoint": str(drafter),
                "num_samples": 3,
                "num_speculative_tokens": [1, 3],
                "temperatures": [0.0, 1.0],
                "max_new_tokens": 40,
            },
            "export": {"num_speculative_tokens": 3, **export},
        },
    )


def logits_of(drafter, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = drafter.config
    ids = torch.randint(0, c.vocab_size, (1, 9), generator=g)
    aux = torch.randn(1, 9, 3 * c.target_hidden_size, generator=g)
    with torch.no_grad():
        return drafter(ids, drafter.fuse(aux), torch.arange(9)[None])[0]


def test_evaluate_writes_report_plots_and_is_lossless(tmp_path, tiny_target, drafter_dir, prompts_file):
    cfg = load_config(make_config(tmp_path, tiny_target, drafter_dir, prompts_file))
    ctx = pipeline.make_context(cfg, "evaluate")
    results = {r.name: r for r in pipeline.run_preflight(ctx)}
    assert results["drafter checkpoint"].status == "ok" and results["evaluation prompts"].status == "ok"

    metrics = cfg.run_path / "train" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(
        "".join(
            json.dumps({"kind": kind, "step": step, "loss": 3.0 / step, "loss_k": [1.0, 2.0], "acc_k": [0.5, 0.3]})
            + "\n"
            for step in (10, 20)
            for kind in ("train", "eval")
        )
    )
    row = pipeline.run_stage(cfg, "evaluate", skip_preflight=True)
    out = cfg.run_path / "evaluate"
    report = json.loads((out / "report.json").read_text())
    assert report["lossless"] is True and report["prompts"] == 3
    assert all(c["lossless"] for c in report["lossless_checks"])
    assert {(r["method"], r["k"], r["temperature"]) for r in report["results"]} == {
        (m, k, t) for m in ("eagle", "ngram") for k in (1, 3) for t in (0.0, 1.0)
    }
    for r in report["results"]:
        assert 1.0 <= r["tau"] <= r["k"] + 1
        assert len(r["acceptance_by_position"]) == r["k"]
        assert all(0.0 <= a <= 1.0 for a in r["acceptance_by_position"])
    assert {(c["k"], c["temperature"]) for c in report["comparison"]} == {(k, t) for k in (1, 3) for t in (0.0, 1.0)}
    for name in ("acceptance_by_position.png", "tau_vs_k.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "training_curves.png").exists(), "the training curves are train/curves.png, drawn once"
    # the tiny target's prompts are all short: one context group, no τ-by-context plot (nor its link in report.md)
    assert not (out / "tau_by_context.png").exists() and "tau_by_context.png" not in (out / "report.md").read_text()
    assert report["warnings"] == [] and row["warnings"] == [], (
        "a drafter that beats n-gram on every prompt asked: no warning"
    )
    md = (out / "report.md").read_text()
    assert "| eagle | 3 |" in md and "| ngram | 1 |" in md and "Lossless: **yes**" in md
    counts = row["counts"]
    assert counts["lossless"] is True and counts["eagle_tau_k3"] == next(
        r["tau"] for r in report["results"] if (r["method"], r["k"], r["temperature"]) == ("eagle", 3, 0.0)
    )

    # the model card carries the evaluation's τ table
    pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert "| eagle | 3 |" in (cfg.run_path / "export" / "README.md").read_text()


def test_a_degenerate_drafter_is_exported_with_its_warnings(tmp_path, tiny_target, prompts_file):
    """An untrained drafter (τ ≈ 1, below n-gram) evaluated on fewer prompts than asked: evaluate warns twice, the
    ledger and `status` keep the warnings, and export still writes the drafter but says so in export/README.md."""
    from eaglekit import status
    from eaglekit.config import TargetConfig
    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
    from eaglekit.model.draft_vocab import build_d2t_t2d
    from eaglekit.model.target import default_aux_layers, embedding_and_head, target_hf_config

    hf = target_hf_config(TargetConfig(model=str(tiny_target)))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(
        DrafterConfig.from_target_config(hf, hf.vocab_size, default_aux_layers(hf.num_hidden_layers))
    )
    d2t, t2d = build_d2t_t2d(torch.arange(hf.vocab_size), hf.vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight.data.copy_(embedding_and_head(str(tiny_target))[0])
    save_legacy(drafter, tmp_path / "untrained")
    config = make_config(tmp_path, tiny_target, tmp_path / "untrained", prompts_file)
    cfg = load_config(config)
    cfg.evaluate.num_samples, cfg.evaluate.num_speculative_tokens, cfg.evaluate.temperatures = 5, [3], [0.0]
    config.write_text(cfg.to_yaml())
    cfg = load_config(config)

    row = pipeline.run_stage(cfg, "evaluate", skip_preflight=True)
    assert len(row["warnings"]) == 2, row["warnings"]
    assert "decoded 3 prompts, fewer than evaluate.num_samples (5)" in row["warnings"][0]
    assert "does not beat the training-free n-gram baseline (K=3" in row["warnings"][1]
    report = json.loads((cfg.run_path / "evaluate" / "report.json").read_text())
    assert report["warnings"] == row["warnings"]

    exported = pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert (cfg.run_path / "export" / "eagle3" / "model.safetensors").exists(), "written anyway"
    assert "exported a drafter from a run with 2 warnings" in exported["warnings"][0]
    card = (cfg.run_path / "export" / "README.md").read_text()
    assert "## Warnings: read before serving" in card and "evaluate: the drafter does not beat" in card

    rows = {r["stage"]: r for r in status.stage_rows(cfg)}
    assert rows["evaluate"]["warnings"] == row["warnings"] and rows["export"]["warnings"] == exported["warnings"]


def test_evaluate_preflight_refuses_a_drafter_for_other_aux_layers(tmp_path, tiny_target, drafter_dir, prompts_file):
    bad = tmp_path / "other_aux"
    shutil.copytree(drafter_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    config.pop("eagle_config", None)
    (bad / "config.json").write_text(json.dumps(config))
    cfg = load_config(make_config(tmp_path, tiny_target, bad, prompts_file))
    results = {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "evaluate"))}
    assert results["drafter checkpoint"].status == "fail"
    assert "aux layers" in results["drafter checkpoint"].detail


@pytest.mark.parametrize("form", ["eagle3", "speculators"])
def test_export_round_trip_gives_identical_logits(tmp_path, tiny_target, drafter_dir, prompts_file, form):
    cfg = load_config(make_config(tmp_path, tiny_target, drafter_dir, prompts_file, verifier="org/tiny-reasoner"))
    pipeline.run_stage(cfg, "export", skip_preflight=True, formats=[form])
    out = cfg.run_path / "export" / form
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    source, _ = load_drafter(drafter_dir)
    written, info = load_drafter(out)
    assert info.form == ("legacy" if form == "eagle3" else "speculators")
    assert torch.equal(logits_of(written), logits_of(source))

    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((tiny_target / "config.json").read_text())
    layer = config if form == "eagle3" else config["transformer_layer_config"]
    assert layer["max_position_embeddings"] == target_config["max_position_embeddings"]
    if form == "speculators":
        assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-reasoner"
        assert config["norm_before_residual"] is False

    readme = (cfg.run_path / "export" / "README.md").read_text()
    if form == "eagle3":
        sglang = next(line for line in readme.splitlines() if line.startswith("python -m sglang.launch_server"))
        args = shlex.split(sglang)
        flag = lambda name: args[args.index(name) + 1]  # noqa: E731
        assert flag("--speculative-algorithm") == "EAGLE3"
        assert Path(flag("--speculative-draft-model-path")) == out.resolve()
        assert (
            flag("--speculative-num-steps"),
            flag("--speculative-eagle-topk"),
            flag("--speculative-num-draft-tokens"),
        ) == ("3", "1", "4")
        vllm = shlex.split(next(line for line in readme.splitlines() if line.startswith("vllm serve")))
        spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
        assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3}
    else:
        assert f"vllm serve {out.resolve()}" in readme


def test_export_without_verifier_names_the_local_target_and_warns(tmp_path, tiny_target, drafter_dir, prompts_file):
    # a null verifier breaks `vllm serve DIR` ("model: Input should be a valid string"): the target's own folder
    # serves on this machine, and the warning says it does not travel
    cfg = load_config(make_config(tmp_path, tiny_target, drafter_dir, prompts_file))
    results = {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "export", formats=["speculators"]))}
    assert results["verifier"].status == "warn" and "not for anyone you publish" in results["verifier"].detail
    row = pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["speculators"])
    assert row["counts"]["warnings"] == 1
    out = cfg.run_path / "export" / "speculators"
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    readme = (cfg.run_path / "export" / "README.md").read_text()
    assert f"vllm serve {out.resolve()}" in readme and "export.verifier" in readme and "publish" in readme


def test_export_refuses_aux_layers_sglang_reads_differently_across_versions(
    tmp_path, tiny_target, drafter_dir, prompts_file
):
    path = make_config(tmp_path, tiny_target, drafter_dir, prompts_file)
    raw = yaml.safe_load(path.read_text())
    raw["target"]["aux_layers"] = [3, 4, 5]
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    results = {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "export"))}
    check = results["SGLang aux layers"]
    assert check.status == "fail" and "sglang#25454" in check.detail and "[3, 4, 5]" in check.detail
    assert "--format speculators" in check.remedy
    with pytest.raises(EaglekitError, match="sglang#25454"):
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert not (cfg.run_path / "export" / "eagle3").exists()
    ctx = pipeline.make_context(cfg, "export", formats=["speculators"])
    assert {r.name: r for r in pipeline.run_preflight(ctx)}["SGLang aux layers"].status == "ok"


def _edit_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda s: s.pop("midlayer.mlp.up_proj.weight"), "midlayer.mlp.up_proj.weight"),
        (lambda s: s.__setitem__("midlayer.extra.weight", torch.zeros(3)), "midlayer.extra.weight"),
        (lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :-1].contiguous()), "fc.weight"),
    ],
)
def test_export_refuses_a_checkpoint_with_wrong_keys(tmp_path, tiny_target, drafter_dir, prompts_file, edit, named):
    bad = _edit_weights(drafter_dir, tmp_path / "bad", edit)
    cfg = load_config(make_config(tmp_path, tiny_target, bad, prompts_file))
    with pytest.raises(EaglekitError, match=named.replace(".", r"\.")):
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3", "speculators"])
    assert not (cfg.run_path / "export" / "eagle3").exists()
    results = {r.name: r for r in pipeline.run_preflight(pipeline.make_context(cfg, "export"))}
    assert results["drafter checkpoint"].status == "fail" and named in results["drafter checkpoint"].detail


@pytest.mark.parametrize(
    "key,value,named",
    [
        ("max_position_embeddings", 4096, "max_position_embeddings"),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_scaling"),
    ],
)
def test_export_refuses_serving_settings_other_than_the_targets(
    tmp_path, tiny_target, drafter_dir, prompts_file, key, value, named
):
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    cfg = load_config(make_config(tmp_path, tiny_target, bad, prompts_file))
    with pytest.raises(EaglekitError, match=named):
        pipeline.run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    assert not (cfg.run_path / "export" / "eagle3").exists()


def test_evaluate_reports_speculative_output_that_differs_from_plain(
    tmp_path, tiny_target, drafter_dir, prompts_file, monkeypatch, capsys
):
    """A verification bug (here: the last greedy token of every eagle run replaced) is what the lossless check is
    for: the report says lossless false, names each prompt and run with its first differing position, and the
    stage prints it."""
    from eaglekit.speculative import decode  # the stage imports its generate when it decodes
    from eaglekit.speculative.ngram import NgramProposer

    real = decode.generate

    def wrong_last_token(target, ids, max_new_tokens, proposer=None, **kw):
        out = real(target, ids, max_new_tokens, proposer=proposer, **kw)
        if proposer is not None and not isinstance(proposer, NgramProposer) and kw.get("temperature") == 0:
            out.tokens[-1] = (out.tokens[-1] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(decode, "generate", wrong_last_token)
    cfg = load_config(make_config(tmp_path, tiny_target, drafter_dir, prompts_file))
    pipeline.run_stage(cfg, "evaluate", skip_preflight=True)
    report = json.loads((cfg.run_path / "evaluate" / "report.json").read_text())
    assert report["lossless"] is False
    for check in report["lossless_checks"]:
        assert check["lossless"] is False
        assert [(d["method"], d["k"]) for d in check["differences"]] == [("eagle", 1), ("eagle", 3)]
        assert all(d["first_difference"] == check["new_tokens"] - 1 for d in check["differences"])
    printed = capsys.readouterr().err
    assert "differs from plain greedy output on 3 prompts" in " ".join(printed.split())

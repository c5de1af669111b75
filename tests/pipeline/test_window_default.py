"""train.draft.sliding_window: auto, the default (model/sliding_window.py): the drafter is windowed when it will be
served 4x or more beyond its training documents' median length, with the largest power of two no longer than
half that length (at most 2,048, longer than train.ttt.steps), and attends everything otherwise; explicit values win. The
choice is resolved once per command (eaglekit.resolved) and reaches the train stage's parameters, the drafter it builds,
its checkpoint and export, plan and pre-flight, which say the same window for the same reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_extract import prepared_run

from eaglekit.config import DFlashDraft, LlamaDraft, MlaDraft, parse_config
from eaglekit.data.tokens import TokenStore
from eaglekit.drafters.registry import fresh_drafter_config
from eaglekit.errors import UsageError
from eaglekit.model.sliding_window import WindowChoice
from eaglekit.pipeline import fingerprint, make_context, run_stage
from eaglekit.preflight.context import serving_context
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir
from eaglekit.stages import train


def draft_window(cfg) -> WindowChoice:
    """The window a command on ``cfg`` as it is now resolves."""
    return ResolvedRun(cfg).window


def median(cfg) -> int:
    lengths = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors").lengths.double()
    return int(lengths.quantile(0.5))


@pytest.fixture
def prepared(tmp_path, tiny_target):
    return prepared_run(tmp_path, tiny_target, n=24)


def test_auto_windows_a_drafter_served_far_beyond_its_documents(prepared):
    cfg = prepared
    assert cfg.train.draft.sliding_window == "auto"  # the default
    typical = median(cfg)
    power = 1 << ((typical // 2).bit_length() - 1)
    assert power <= typical // 2 < 2 * power and power > cfg.train.ttt.steps

    # the tiny target's own 1,024 positions: a short served context, no window (the demo's drafter stays as it was)
    short = draft_window(cfg)
    assert short.window is None and "a short context" in short.why
    assert fresh_drafter_config(cfg).sliding_window is None

    cfg.evaluate.context_lengths = [4 * typical]  # served 4x the documents: windowed, every attended distance trained
    on = draft_window(cfg)
    assert on.window == power, on
    assert (
        f"documents of {typical:,} tokens (median" in on.why and "largest power of two not longer than half" in on.why
    )
    assert fresh_drafter_config(cfg).sliding_window == power  # the drafter train builds
    cfg.evaluate.context_lengths = [4 * typical - 1]  # just under 4x: full attention
    under = draft_window(cfg)
    assert under.window is None and "under 4x" in under.why

    cfg.evaluate.context_lengths = [1 << 20]
    cfg.train.ttt.steps = power  # a window must be longer than the TTT chain: none then
    chained = draft_window(cfg)
    assert chained.window is None and "train.ttt.steps" in chained.why


def test_a_few_long_rows_among_short_ones_keep_the_window_of_the_short(prepared, monkeypatch):
    """The legend target's mix (benchmarks/results/long-context.md, "The default on v6"): 160 short rows and 24 of
    4K-20K tokens, served at its 32,768 positions. Auto reads the median row: the window the short rows train (256), where the 95th percentile
    would turn it off, a drafter served 3.5x its long rows. Pre-flight reads the same median: no warning."""
    from eaglekit.model import sliding_window

    cfg = prepared
    mix = sliding_window.TrainingLengths(median=724, p95=9417, longest=20444, prepared=True)
    monkeypatch.setattr(sliding_window, "training_lengths", lambda cfg: mix)
    cfg.evaluate.context_lengths = [32768]
    today = draft_window(cfg)
    assert today.window == 256 and "documents of 724 tokens (median; 95th percentile 9,417)" in today.why
    check = serving_context(make_context(cfg, "train"))
    assert check.status == "ok" and f"({today.why})" in check.detail, check


def test_auto_before_prepare_reads_prepare_max_length_and_caps_at_2048(tmp_path, tiny_target):
    """plan runs before prepare: prepare.max_length stands in for the documents, and the window is at most 2,048
    (speculators' default) however long they are."""
    base = {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "p.jsonl"}}
    cfg = parse_config({**base, "prepare": {"max_length": 6000}, "evaluate": {"context_lengths": [131072]}},
                       base_dir=tmp_path)  # fmt: skip
    choice = draft_window(cfg)
    assert choice.window == 2048 and "prepare.max_length" in choice.why and "at most 2,048" in choice.why
    cfg.evaluate.context_lengths = [20000]  # 3.3x the stand-in: off
    assert draft_window(cfg).window is None


def test_explicit_windows_win_and_null_or_off_says_none(prepared):
    cfg = prepared
    cfg.evaluate.context_lengths = [1 << 20]
    cfg.train.draft.sliding_window = 100
    assert draft_window(cfg).window == 100 and fresh_drafter_config(cfg).sliding_window == 100
    cfg.train.draft.sliding_window = None  # served far beyond, and no window asked for: none
    assert draft_window(cfg).window is None and "null" in draft_window(cfg).why
    assert fresh_drafter_config(cfg).sliding_window is None
    check = serving_context(make_context(cfg, "train"))  # pre-flight warns, and names auto's way out
    assert check.status == "warn" and "remove train.draft.sliding_window: null" in check.remedy

    # YAML's unquoted off / false and the word none are null; true is no size
    for model in (LlamaDraft, DFlashDraft):
        for written in (None, False, "off", "none"):
            assert model(sliding_window=written).sliding_window is None
        assert model().sliding_window == "auto"
        with pytest.raises(ValueError, match="true is not a window"):
            model(sliding_window=True)
        with pytest.raises(ValueError):
            model(sliding_window=1)


def test_mla_takes_no_window_so_auto_is_off_there(prepared):
    cfg = prepared
    cfg.evaluate.context_lengths = [1 << 20]
    cfg.train.draft = {"architecture": "mla"}
    choice = draft_window(cfg)
    assert choice.window is None and choice.why == "auto: off (architecture mla takes no sliding window)"
    assert MlaDraft(sliding_window="auto").window is None  # auto asks nothing of MLA: taken, not refused
    with pytest.raises(UsageError, match="architecture mla does not read sliding_window"):
        parse_config({"target": {"model": "x"}, "data": {"prompts": "p"},
                      "train": {"draft": {"architecture": "mla", "sliding_window": 512}}})  # fmt: skip
    check = serving_context(make_context(cfg, "train"))  # pre-flight still warns: nothing holds this drafter
    assert check.status == "warn" and "takes no sliding window" in check.detail


def test_block_drafters_take_the_auto_window(prepared):
    cfg = prepared
    cfg.evaluate.context_lengths = [1 << 20]
    cfg.train.draft = {"architecture": "dflash", "mask_token_id": 0}
    window = draft_window(cfg).window
    assert window is not None and fresh_drafter_config(cfg).sliding_window == window


def test_the_resolved_window_is_the_train_stages_parameter(prepared):
    """Recorded resolved, not as "auto": serving longer moves the fingerprint (the drafter must be retrained);
    writing out the value auto chose does not."""
    cfg = prepared
    short = fingerprint(cfg, "train")
    assert train.params(ResolvedRun(cfg))["draft"]["sliding_window"] is None
    cfg.evaluate.context_lengths = [1 << 20]
    window = draft_window(cfg).window
    assert train.params(ResolvedRun(cfg))["draft"]["sliding_window"] == window
    served_long = fingerprint(cfg, "train")
    assert served_long != short
    cfg.train.draft.sliding_window = window
    assert fingerprint(cfg, "train") == served_long


def test_plan_pre_flight_and_train_say_the_same_window_for_the_same_reason(prepared, capsys):
    """One resolution, three readers: the plan's line, pre-flight's check and train's log and ledger entry."""
    from eaglekit.planning import plan

    cfg = prepared
    cfg.evaluate.context_lengths = [1 << 20]
    for key, value in {"max_steps": 2, "eval_every": 2, "save_every": 2, "eval_samples": 4, "warmup_steps": 1}.items():
        setattr(cfg.train, key, value)
    choice = draft_window(cfg)
    assert choice.window is not None and choice.why.startswith(f"auto: {choice.window:,} (served at up to 1,048,576")

    doc = plan(cfg, free_bytes=1 << 40, write_bytes_per_s=1e9)
    (row,) = [s for s in doc["stages"] if s["stage"] == "train"]
    planned = next(h for h in row["how"] if h.startswith("sliding window"))
    check = serving_context(make_context(cfg, "train"))
    capsys.readouterr()
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train", skip_preflight=True)
    printed = capsys.readouterr().err
    (end,) = [e for e in RunDir(cfg.run_dir).events() if e.get("stage") == "train" and e.get("event") == "end"]

    assert planned == f"sliding window: {choice.shown} — {choice.why}"
    assert check.status == "ok" and f"a {choice.shown}-token window ({choice.why})" in check.detail
    assert f"train: sliding window {choice.shown} ({choice.why})" in " ".join(printed.split())
    assert end["sliding_window"] == {"window": choice.window, "why": choice.why}


def test_the_auto_window_reaches_the_checkpoint_the_export_and_the_sglang_command(prepared):
    cfg = prepared
    cfg.evaluate.context_lengths = [1 << 20]
    for key, value in {"max_steps": 2, "eval_every": 2, "save_every": 2, "eval_samples": 4, "warmup_steps": 1}.items():
        setattr(cfg.train, key, value)
    cfg.export.formats = ["eagle3"]
    window = draft_window(cfg).window
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "train", skip_preflight=True)
        run_stage(cfg, "export", skip_preflight=True, formats=["eagle3"])
    run = Path(cfg.run_dir)
    checkpoint = json.loads((run / "train" / "checkpoints" / "best" / "config.json").read_text())
    exported = json.loads((run / "export" / "eagle3" / "config.json").read_text())
    for config in (checkpoint, exported):
        assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == window
    assert f"--speculative-draft-window-size {window}" in (run / "export" / "README.md").read_text()
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    (start,) = [e for e in ledger if e["stage"] == "train" and e["event"] == "start"]
    (end,) = [e for e in ledger if e["stage"] == "train" and e["event"] == "end"]
    assert start["params"]["draft"]["sliding_window"] == window
    assert end["sliding_window"]["window"] == window and end["sliding_window"]["why"].startswith("auto:")


def test_the_demo_keeps_full_attention(tmp_path, tiny_target):
    """The demo's target serves 1,024 positions: auto leaves its drafter, and the README's figures, as they were."""
    from eaglekit.demo import demo_config

    cfg = parse_config({**demo_config(tiny_target), "run_dir": "run"}, base_dir=tmp_path)
    assert cfg.train.draft.sliding_window == "auto"
    choice = draft_window(cfg)
    assert choice.window is None and "a short context" in choice.why


def test_the_served_context_follows_the_targets_config_when_it_changes(tmp_path):
    """target_hf_config reads a config once per version of the file (plan asks a dozen times): a target whose
    config.json is rewritten (its context raised) is served at the new context, and a caller that changes the config
    it was given changes nothing for the next."""
    from transformers import LlamaConfig

    from eaglekit.model.target import target_hf_config

    target = tmp_path / "target"
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2}
    LlamaConfig(**shape, max_position_embeddings=4096).save_pretrained(target)
    cfg = parse_config(
        {"run_dir": str(tmp_path / "run"), "target": {"model": str(target)}, "data": {"prompts": "prompts.jsonl"}}
    )
    first = ResolvedRun(cfg).served
    assert first is not None and first.tokens == 4096 and not first.long
    target_hf_config(cfg.target).max_position_embeddings = 1  # the caller's copy
    assert ResolvedRun(cfg).served == first
    LlamaConfig(**shape, max_position_embeddings=32768).save_pretrained(target)
    raised = ResolvedRun(cfg).served
    assert raised is not None and raised.tokens == 32768 and raised.long

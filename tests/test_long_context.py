"""Long context: pre-flight's serving-context check (a drafter trained on short documents and served far beyond them
is warned about before training, and a sliding window the training documents fill is what it asks for), and
evaluate's τ by context length."""

from __future__ import annotations

from test_extract import prepared_run

from eaglekit.pipeline import make_context
from eaglekit.preflight.context import serving_context


def test_serving_far_beyond_the_training_documents_is_warned_before_training(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=24)
    # the tiny target's own context (1,024 positions) is no long context: what it serves is short, nothing to say
    healthy = serving_context(make_context(cfg, "train"))
    assert healthy.status == "ok", healthy
    assert "the target's max_position_embeddings" in healthy.detail

    cfg.evaluate.context_lengths = [4096, 32768]
    far = serving_context(make_context(cfg, "train"))
    assert far.status == "warn" and "32,768" in far.detail and "95th percentile" in far.detail
    assert "train.draft.sliding_window" in far.remedy
    assert serving_context(make_context(cfg, "evaluate")).status == "warn"  # evaluate's pre-flight says it too

    cfg.train.draft.sliding_window = 64  # a window the documents fill: the drafter never attends farther
    assert serving_context(make_context(cfg, "train")).status == "ok"
    cfg.train.draft.sliding_window = 100_000  # a window longer than any training document: never trained whole
    wide = serving_context(make_context(cfg, "train"))
    assert wide.status == "warn" and "never trained" in wide.detail


def test_evaluate_reports_tau_by_context_length_when_the_prompts_span_groups():
    from eaglekit.data.eval_report import context_table
    from eaglekit.speculative.decode import CONTEXT_BUCKETS, DecodeStats, Generation, tau_by_context

    groups = [label for label, _ in CONTEXT_BUCKETS]
    short = Generation(tokens=[], stats=DecodeStats(), accepted_per_round=[3, 3, 2], context_per_round=[100, 110, 120])
    long = Generation(tokens=[], stats=DecodeStats(), accepted_per_round=[1, 0], context_per_round=[20_000, 20_004])
    by = {label: {"rounds": g["rounds"], "tau": g["tau"]} for label, g in tau_by_context([short, long]).items()}
    assert by["<1k"]["tau"] > by[">16k"]["tau"] and "1-4k" not in by
    row = {"method": "eagle", "k": 3, "temperature": 0.0, "tau_by_context": by}
    table = "\n".join(context_table([row], groups))
    assert "| <1k | 1-4k | 4-16k | >16k |" in table and "| eagle | 3 | 0 | " in table and "–" in table
    one_group = {**row, "tau_by_context": {"<1k": by["<1k"]}}
    assert context_table([one_group], groups) == []  # nothing to compare: no table
    assert context_table([{**row, "method": "ngram"}], groups) == []


def test_the_window_remedy_is_offered_where_a_window_can_be_trained(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=24)
    cfg.evaluate.context_lengths = [32768]
    cfg.train.draft.architecture = "mla"  # eaglekit trains windows for llama EAGLE-3 and block drafters only
    check = serving_context(make_context(cfg, "train"))
    assert check.status == "warn" and "sliding_window" not in check.remedy and "longer documents" in check.remedy
    cfg.train.draft.architecture = "dflash"
    assert "train.draft.sliding_window" in serving_context(make_context(cfg, "train")).remedy


def test_the_memory_model_calibrates_windows_for_long_ttt_chains():
    """A window far longer than the calibration rows and a TTT chain of 40 steps: the calibration drafter keeps a
    window longer than the chain, as ttt_loss requires (it refused it before)."""
    from test_drafter_ttt import tiny_config

    from eaglekit.training.memory import step_memory

    m = step_memory(tiny_config(sliding_window=4096), 16384, 40, trainable=1000, frozen=1000, bf16=False)
    assert m.per_token > 0 and m.total > m.activations > 0

"""Pre-flight's serving-context check: a drafter trained on short documents and served far beyond them is warned
about before training (trained-short drafters lose most of their acceptance at long context), and a sliding
window the training documents fill is what it asks for."""

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

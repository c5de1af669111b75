"""Long context: pre-flight's serving-context check (a drafter trained on short documents and served far beyond them
is warned about before training, and a sliding window the training documents fill is what it asks for), and
evaluate's τ by context length."""

from __future__ import annotations

from test_extract import prepared_run

from eaglekit.pipeline import make_context
from eaglekit.preflight.context import serving_context
from eaglekit.speculative.decode import DecodeStats, Generation


def test_serving_far_beyond_the_training_documents_is_warned_before_training(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=24)
    # the tiny target's own context (1,024 positions) is no long context: what it serves is short, nothing to say
    healthy = serving_context(make_context(cfg, "train"))
    assert healthy.status == "ok", healthy
    assert "the target's max_position_embeddings" in healthy.detail

    cfg.evaluate.context_lengths = [4096, 32768]
    cfg.train.draft.sliding_window = (
        None  # no window asked for (auto would window it: tests/pipeline/test_window_default.py)
    )
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


def test_tau_by_context_is_plotted_when_the_passes_span_groups(tmp_path):
    """What the table says is drawn too (evaluate writes tau_by_context.png and links it from report.md): one line per
    drafter row, a point per group its passes started in."""
    from eaglekit import plots
    from eaglekit.data.eval_report import context_rows
    from eaglekit.speculative.decode import CONTEXT_BUCKETS

    groups = [label for label, _ in CONTEXT_BUCKETS]
    spans = {"<1k": {"rounds": 3, "tau": 3.7}, "4-16k": {"rounds": 2, "tau": 3.1}, ">16k": {"rounds": 4, "tau": 2.2}}
    rows = [{"method": "eagle", "k": k, "temperature": 0.0, "tau_by_context": spans} for k in (3, 5)] + [
        {"method": "eagle", "k": 7, "temperature": 0.0, "tau_by_context": {"<1k": spans["<1k"]}}
    ]
    drawn = context_rows(rows)
    assert [r["k"] for r in drawn] == [3, 5]  # a row whose passes all fell in one group has nothing to draw
    fig = plots.tau_by_context(drawn, groups, tmp_path / "tau_by_context.png")
    assert (tmp_path / "tau_by_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["eagle K=3 T=0", "eagle K=5 T=0"]
    xs, ys = ax.get_lines()[0].get_data()
    assert list(xs) == [0, 2, 3] and list(ys) == [3.7, 3.1, 2.2]  # the empty 1-4k group is left out of the line
    assert [t.get_text() for t in ax.get_xticklabels()] == groups


def test_verify_places_each_served_pass_where_its_draft_starts_and_reports_tau_by_context():
    """vLLM reports each request's accepted counts per pass; verify places the passes by context as eaglekit's own
    decoding does (prompt, the prefill's token, then each pass's accepted drafts and token), so that a drafter
    that falls served at long context is read apart from one that falls offline too."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglekit.data.verify_report import context_table, verdict_counts
    from eaglekit.serving.speculation import Counters, Served
    from eaglekit.speculative.decode import generate, served_context_per_round
    from eaglekit.stages.verify import Offline, ServedRun, served_tau_by_context

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=96, num_key_value_heads=2, head_dim=8, **shape)).eval()
    prompt = torch.randint(0, 96, (1100,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(target, prompt[:40], 24)

    class HalfRight:  # proposes the greedy continuation with its first two drafts right
        aux_layer_ids = None

        def reset(self, ids, aux):
            self.done = len(ids) - 40

        def propose(self, k, temperature, generator):
            truth = plain.tokens[self.done : self.done + k] + [0] * k
            return [t if i < 2 else (t + 1) % 96 for i, t in enumerate(truth[:k])], None

        def update(self, new_ids, aux):
            self.done += len(new_ids)

    gen = generate(target, prompt[:40], 24, proposer=HalfRight(), k=4, engine_accounting=True)
    assert served_context_per_round(40, gen.accepted_per_round) == gen.context_per_round

    # two prompts, one short and one past 1K: the served passes of the long one accept less than offline
    short, long_ = (
        gen,
        Generation(tokens=[1], stats=DecodeStats(), accepted_per_round=[3, 3], context_per_round=[1101, 1105]),
    )
    offline = Offline(prompts=[("a", prompt[:40]), ("b", prompt)], stop_ids=[], aux=[])
    offline.eagle[4] = {"a": short, "b": long_}
    served = {"a": Served(gen.tokens, gen.accepted_per_round), "b": Served([1], [0, 1])}
    run = ServedRun("eagle3", 4, "vllm", "vllm serve", served, Counters())
    by = served_tau_by_context(run, offline)
    assert by is not None and list(by) == ["<1k", "1-4k"]
    assert by["<1k"]["served"] == by["<1k"]["offline"]
    assert by["1-4k"]["served"] == {"rounds": 2, "tau": 1.5} and by["1-4k"]["offline"] == {"rounds": 2, "tau": 4.0}
    report = {
        "verdict": "FAIL",
        "engine": "vllm",
        "prompts": 2,
        "runs": [
            {"form": "eagle3", "k": 4, "tau_by_context": by, "tau": {"served": 2.0, "offline": 3.0}, "passed": False}
        ],
    }
    assert verdict_counts(report)["tau_eagle3_k4_1-4k"] == "served 1.500 / offline 4.000"
    assert "| eagle3 | 4 | 1-4k | 1.500 (2) | 4.000 (2) |" in context_table(report)
    assert served_tau_by_context(ServedRun("eagle3", 4, "sglang", "x", served, Counters()), offline) is None
    served["b"] = Served([1], None)  # an engine without per-request counts: nothing to place
    assert served_tau_by_context(run, offline) is None


def test_the_window_remedy_is_offered_where_a_window_can_be_trained(tmp_path, tiny_target):
    cfg = prepared_run(tmp_path, tiny_target, n=24)
    cfg.evaluate.context_lengths = [32768]
    cfg.train.draft = {"architecture": "mla"}  # eaglekit trains windows for llama EAGLE-3 and block drafters only
    check = serving_context(make_context(cfg, "train"))
    assert check.status == "warn" and "sliding_window" not in check.remedy and "longer documents" in check.remedy
    cfg.train.draft = {"architecture": "dflash"}
    assert serving_context(make_context(cfg, "train")).status == "ok"  # auto windows it
    cfg.train.draft.sliding_window = None
    assert "train.draft.sliding_window" in serving_context(make_context(cfg, "train")).remedy


def test_the_memory_model_calibrates_windows_for_long_ttt_chains():
    """A window far longer than the calibration rows and a TTT chain of 40 steps: the calibration drafter keeps a
    window longer than the chain, as ttt_loss requires (it refused it before)."""
    from test_drafter_ttt import tiny_config

    from eaglekit.drafters.eagle3.memory import step_memory

    m = step_memory(tiny_config(sliding_window=4096), 16384, 40, trainable=1000, frozen=1000, bf16=False)
    assert m.per_token > 0 and m.total > m.activations > 0

"""The run lifecycle as a user meets it: usage errors, unexpected errors, disk faults, reruns that never destroy
finished work, remedies that name the exact command, and a `status` that tells the truth.

Most cases drive the real CLI over fake stages (each writes one file), so they run in milliseconds; the disk-full
case generates with the tiny target on a real, deliberately small tmpfs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import REPO, mounted_tmpfs, subprocess_env, write_config
from test_rundir import fake_stage

from eaglekit import pipeline, status
from eaglekit.config import load_config
from eaglekit.preflight import warn
from eaglekit.rundir import RunDir

BASE = {"run_dir": "run", "target": {"model": "model"}, "data": {"prompts": "prompts.jsonl"}}
STAGES = ["generate", "prepare", "vocab", "train", "evaluate", "export"]  # online mode: no extract


@pytest.fixture
def fakes(monkeypatch):
    calls: list[str] = []
    ups = {
        "generate": None,
        "prepare": "generate",
        "vocab": "prepare",
        "extract": "vocab",
        "train": "extract",
        "evaluate": "train",
        "export": "evaluate",
        "verify": "export",
    }
    mods = {name: fake_stage(name, up, calls) for name, up in ups.items()}
    monkeypatch.setattr(pipeline, "stage_of", lambda name: mods[name])
    return mods, calls


def config(tmp_path: Path, name: str = "c.yaml", **sections) -> Path:
    return write_config(tmp_path / name, {**BASE, **sections})


def ledger(run_dir: Path) -> list[dict]:
    return list(RunDir(run_dir).events())


# ------------------------------------------------------------------------------------------ usage errors

USAGE_ERRORS = [
    ([], "no command given"),
    (["run"], "Missing argument 'CONFIG'"),
    (["status"], "Missing argument 'RUN_DIR'"),
    (["--bogus"], "No such option: --bogus"),
    (["run", "{cfg}", "--from"], "Option '--from' requires an argument"),
    (["trian", "{cfg}"], "No such command 'trian'. Did you mean 'train'?"),
    (["run", "{cfg}", "other.yaml"], "unexpected extra argument"),
    (["run", "{cfg}", "--json", "--bogus"], "No such option: --bogus"),
]


@pytest.mark.parametrize("args, says", USAGE_ERRORS, ids=[" ".join(a) or "bare" for a, _ in USAGE_ERRORS])
def test_usage_errors_are_one_line_with_the_usage_and_exit_2(tmp_path, cli, args, says):
    cfg = config(tmp_path)
    r = cli(*[a.replace("{cfg}", str(cfg)) for a in args])
    assert r.code == 2, r.err
    assert "Traceback" not in r.err + r.out and r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert says in lines[0] and "--help" in lines[0]


def test_from_after_until_is_a_usage_error(tmp_path, cli, fakes):
    r = cli("run", config(tmp_path), "--from", "train", "--until", "prepare")
    assert r.code == 2 and "--from train comes after --until prepare" in r.err and "Traceback" not in r.err
    assert fakes[1] == [], "nothing ran"


def test_version(cli):
    import importlib.metadata as md

    r = cli("--version")
    assert r.code == 0 and r.out.strip() == f"eaglekit {md.version('eaglekit')}"


def test_help_lists_stages_in_pipeline_order_and_what_each_reads_and_writes(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # no wrapping inside the phrases looked for
    r = cli("--help")
    commands = r.out[r.out.index("Commands") :]
    positions = [re.search(rf"\b{s}\b", commands).start() for s in ["run", *STAGES[:3], "extract", *STAGES[3:]]]
    assert positions == sorted(positions), commands
    run_help = cli("run", "--help").out
    assert "first stage to run: generate | prepare | vocab | extract | train | evaluate | export" in run_help
    for stage in ("generate", "prepare", "vocab", "extract", "train", "evaluate", "export"):
        text = " ".join(cli(stage, "--help").out.split())
        assert "Reads" in text and "writes" in text and f"{stage}/" in text, (stage, text)


def test_demo_does_not_import_the_cli():
    """The lock-holding runner lives in pipeline, which the CLI and the demo both import: no cycle."""
    code = "import sys, eaglekit.demo; print('eaglekit.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------ unexpected errors


def test_an_unexpected_exception_is_a_short_message_with_the_traceback_in_a_log(tmp_path, cli, fakes):
    mods, calls = fakes
    mods["prepare"] = fake_stage(
        "prepare", "generate", calls, fail=ZeroDivisionError("division by zero in the tokenizer")
    )
    cfg = config(tmp_path)
    r = cli("run", cfg)
    assert r.code == 1 and "Traceback" not in r.err
    assert "prepare stopped on an unexpected error: ZeroDivisionError: division by zero in the tokenizer" in r.err
    assert "every finished stage is untouched" in r.err and "`eaglekit --debug ...` prints it" in r.err
    log = Path(re.search(r"traceback is in (\S+)", r.err).group(1))
    assert log.parent == tmp_path / "run" / "logs"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError" in text and "stage: prepare" in text
    end = [e for e in ledger(tmp_path / "run") if e.get("stage") == "prepare" and e["event"] == "end"][-1]
    assert end["state"] == "failed" and end["log"] == str(log)

    r = cli("--debug", "run", cfg)
    assert r.code == 1 and "Traceback (most recent call last)" in r.err and "ZeroDivisionError" in r.err


# ------------------------------------------------------------------------------- reruns keep finished work


def test_force_replaces_only_what_needs_it_and_remedies_name_the_command(tmp_path, cli, fakes):
    _, calls = fakes
    cfg = config(tmp_path)
    assert cli("run", cfg).code == 0 and calls == STAGES
    config(tmp_path, prepare={"max_length": 99})  # the user edits one prepare parameter

    calls.clear()
    r = cli("run", cfg)
    assert r.code == 1 and calls == [], "a finished stage's outputs are never replaced without --force"
    assert "generate: done with the same inputs and parameters, skipped" in r.err
    assert "prepare.n: 0 → 99" not in r.err and "prepare.n: 2048 → 99" in r.err, "says what changed"
    assert f"eaglekit run {cfg} --from prepare --force" in r.err, "the remedy is the exact command"

    r = cli("run", cfg, "--force")
    assert r.code == 0 and calls == STAGES[1:], "--force reruns what changed; the finished generate is kept"
    calls.clear()
    r = cli("run", cfg, "--force")
    assert r.code == 0 and calls == [], "--force never reruns a stage done with the same parameters"


def test_a_failed_attempt_is_replaced_without_force(tmp_path, cli, fakes):
    mods, calls = fakes
    mods["prepare"] = fake_stage("prepare", "generate", calls, fail=lambda c: c.prepare.max_length == 2048)
    cfg = config(tmp_path)
    r = cli("run", cfg)
    assert r.code == 1 and "prepare broke" in r.err
    rows = status.stage_rows(load_config(cfg))
    assert [r["state"] for r in rows[:2]] == ["done", "failed"]
    steps = status.next_steps(load_config(cfg), rows, cfg.name)
    assert (
        "what the failed attempt left is replaced" in steps[1]
        and steps[2] == f"  eaglekit run {cfg.name} --from prepare"
    )

    config(tmp_path, prepare={"max_length": 99})  # the fix
    r = cli("run", cfg)  # no --force: what the failed attempt left is not finished work
    assert r.code == 0, r.err
    assert "prepare: replacing" in r.err and calls.count("generate") == 1


def test_upstream_remedy_names_the_whole_way(tmp_path, cli, fakes):
    cfg = config(tmp_path)
    assert cli("generate", cfg).code == 0
    r = cli("train", cfg)
    assert r.code == 1
    assert f"`eaglekit run {cfg} --from prepare --until vocab`" in r.err, r.err


# -------------------------------------------------------------------------------------------- disk full


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "64k") as mnt:
        yield mnt


@pytest.mark.slow
def test_disk_full_mid_generate_names_the_file_keeps_every_line_and_resumes(tmp_path, tiny_target, small_tmpfs, cli):
    from eaglekit.tiny import write_prompts

    write_prompts(tmp_path / "prompts.jsonl", n=120, seed=7)
    cfg = write_config(
        tmp_path / "c.yaml",
        {
            "run_dir": str(small_tmpfs / "run"),
            "target": {"model": str(tiny_target)},
            "data": {"prompts": str(tmp_path / "prompts.jsonl")},
            "generate": {"backend": "local", "max_tokens": 160, "batch_size": 32},
        },
    )
    # Pre-flight would refuse this disk (its estimate exceeds 64 KiB): skip it, as a disk filled by another
    # process after the check would.
    r = cli("generate", cfg, "--skip-preflight")
    assert r.code == 1 and "Traceback" not in r.err
    responses = small_tmpfs / "run" / "generate" / "responses.jsonl"
    assert f"generate: disk full writing {responses}" in " ".join(r.err.split())
    kept = int(re.search(r"(\d+) responses are safely in", r.err).group(1))
    lines = responses.read_text().splitlines()
    assert 0 < kept == len(lines) and all(json.loads(line)["id"] for line in lines), "every line a whole record"
    assert "free there; the plan needs about" in r.err and "then rerun the same command to resume" in r.err
    end = [e for e in ledger(small_tmpfs / "run") if e.get("event") == "end"]
    if end:
        assert end[-1]["state"] == "failed" and end[-1]["reason"] == "disk full"
    else:
        assert "the ledger" in r.err and "could not be written either" in r.err

    subprocess.run(["mount", "-o", "remount,size=4m", str(small_tmpfs)], check=True)  # the user frees space
    r = cli("generate", cfg)
    assert r.code == 0, r.err
    ids = [json.loads(line)["id"] for line in responses.read_text().splitlines()]
    assert len(ids) == len(set(ids)) and ids[:kept] == [json.loads(line)["id"] for line in lines]
    counts = [e for e in ledger(small_tmpfs / "run") if e.get("event") == "end"][-1]["counts"]
    assert counts["skipped_existing"] == kept and counts["done"] == len(ids) == kept + counts["new"], counts


# ------------------------------------------------------------------------------------------------ status


def test_status_of_a_run_dir_compares_with_the_config_that_last_drove_it(tmp_path, cli, fakes):
    cfg = config(tmp_path, "mine.yaml")
    assert cli("run", cfg).code == 0
    config(tmp_path, "mine.yaml", prepare={"max_length": 99})  # edited after the run

    doc = json.loads(cli("status", tmp_path / "run", "--json").out)
    states = {r["stage"]: r["state"] for r in doc["stages"]}
    assert states == {"generate": "done", **{s: "stale" for s in STAGES[1:]}}
    assert "mine.yaml, the config that last drove this run (edited since)" in doc["compared"]
    prepare = next(r for r in doc["stages"] if r["stage"] == "prepare")
    assert prepare["reason"] == "prepare.n: 2048 → 99"

    r = cli("status", tmp_path / "run")
    assert r.code == 0 and r.out, "the table goes to stdout (status | less works)"
    lines = r.out.splitlines()
    command = f"  eaglekit run {status.relative(cfg)} --from prepare --force"
    assert command in lines, "the command is whole on its own line"
    assert max(len(line) for line in lines if line != command) <= 80, r.out
    assert "eaglekit run" not in lines[0], "no misleading title"
    table_end = max(i for i, line in enumerate(lines) if line.startswith("export"))
    follow = "\n".join(lines[table_end + 1 :])
    assert "prepare is stale: prepare.n: 2048 → 99" in follow and command in follow
    assert "pre-flight" in cli("status", tmp_path / "run", "--wide").out

    (tmp_path / "mine.yaml").unlink()  # the file is gone: compare with the run's own copy, and say so
    doc = json.loads(cli("status", tmp_path / "run", "--json").out)
    assert "is gone" in doc["compared"] and {r["state"] for r in doc["stages"]} == {"done"}


RUN_WITH_A_BLOCKING_TRAIN = """
import pathlib, sys, time
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/pipeline"]  # support/, and test_rundir beside this test
from eaglekit import pipeline
from test_rundir import fake_stage
calls = []
ups = {"generate": None, "prepare": "generate", "vocab": "prepare", "extract": "vocab", "train": "extract",
       "evaluate": "train", "export": "evaluate", "verify": "export"}
mods = {n: fake_stage(n, u, calls) for n, u in ups.items()}
def blocking(ctx):
    print("train started", flush=True)
    while not pathlib.Path(sys.argv[2]).exists():
        time.sleep(0.05)
    return {}
mods["train"].run = blocking
pipeline.stage_of = lambda n: mods[n]
from eaglekit.cli import main
main(["run", sys.argv[1]])
"""


def test_status_shows_what_runs_now_and_what_will_run(tmp_path, fakes):
    cfg = config(tmp_path)
    gate = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_WITH_A_BLOCKING_TRAIN, str(cfg), str(gate), str(REPO / "tests")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "train started", proc.stderr.read()
        loaded = load_config(cfg)
        rows = status.stage_rows(loaded)
        assert {r["stage"]: r["state"] for r in rows} == {
            "generate": "done",
            "prepare": "done",
            "vocab": "done",
            "train": "running",
            "evaluate": "queued",
            "export": "queued",
        }
        steps = "\n".join(status.next_steps(loaded, rows, "c.yaml"))
        assert "train is running" in steps and f"pid {proc.pid}" in steps and "then evaluate, export" in steps
    finally:
        gate.touch()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert {r["state"] for r in status.stage_rows(load_config(cfg))} == {"done"}


def test_status_shows_preflight_warnings_and_bad_data(tmp_path, cli, fakes):
    mods, calls = fakes
    generate_run = mods["generate"].run
    mods["generate"].run = lambda ctx: {**generate_run(ctx), "done": 10, "empty_reasoning": 2, "leftover_think": 1}

    def prepare_run(ctx):
        ctx.warn("3 of 10 responses (30%) dropped as cut off at generate.max_tokens")
        return {"samples": 7}

    mods["prepare"].run = prepare_run
    mods["vocab"].checks = lambda cfg: [lambda ctx: warn("vocab size", "larger than the data needs", "lower it")]
    cfg = config(tmp_path)
    assert cli("run", cfg, "--until", "vocab").code == 0

    rows = {r["stage"]: r for r in json.loads(cli("status", cfg, "--json").out)["stages"]}
    assert rows["generate"]["flags"][:2] == [
        "2 of 10 responses have empty reasoning",
        "1 of 10 replies keep think tags in their content (reasoning not separated)",
    ]
    assert rows["prepare"]["warnings"] == ["3 of 10 responses (30%) dropped as cut off at generate.max_tokens"]
    assert rows["vocab"]["preflight"]["warn"] == 1 and rows["vocab"]["preflight"]["fail"] == 0
    assert rows["vocab"]["preflight"]["ts"]
    text = " ".join(cli("status", cfg).out.split())
    for line in (
        "generate: 2 of 10 responses have empty reasoning",
        "prepare: warning: 3 of 10 responses (30%) dropped",
        "vocab: last pre-flight",
        "0 fail, 1 warn — vocab size: larger than the data needs",
        f"next: eaglekit run {status.relative(cfg)} --from train",
    ):
        assert line in text, (line, text)


# ------------------------------------------------------------------------------------ train: Ctrl-C, SIGTERM

INTERRUPTED_TRAIN = """
import os, signal, sys
from eaglekit.training import loop
write = loop.Metrics.write
def write_then_signal(self, row):
    write(self, row)
    if row["kind"] == "train" and row["step"] == 2:
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # as if Ctrl-C / a scheduler's SIGTERM came now
loop.Metrics.write = write_then_signal
from eaglekit.cli import main
main(["train", sys.argv[1]])
"""
TRAIN = {
    "ttt": {"steps": 2},
    "batch_size": 4,
    "lr": 1e-3,
    "warmup_steps": 1,
    "eval_samples": 4,
    "max_steps": 4,
    "save_every": 100,
    "eval_every": 100,
    "log_every": 1,
}


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_in_train_finishes_the_step_checkpoints_and_resumes(tmp_path, tiny_target, signal_name, code):
    from test_extract import prepared_run

    cfg = prepared_run(tmp_path, tiny_target, n=24, train=TRAIN)
    path = Path(cfg.run_dir) / "config.yaml"
    path.write_text(cfg.to_yaml())
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_TRAIN, str(path), signal_name],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    checkpoints = Path(cfg.run_dir) / "train" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-2", "the step in progress finished, then a checkpoint"
    assert "checkpoint step-2 is written" in proc.stderr and "rerun the same command to resume" in proc.stderr
    end = [e for e in ledger(Path(cfg.run_dir)) if e.get("stage") == "train" and e["event"] == "end"][-1]
    assert end["state"] == "incomplete" and signal_name in end["error"]

    with RunDir(cfg.run_dir).lock:
        row = pipeline.run_stage(load_config(path), "train")
    assert row["counts"]["steps"] == 4
    steps = [
        json.loads(line)["step"]
        for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4], "resumed after step 2, nothing lost or repeated"


@pytest.mark.slow
def test_train_checkpoints_on_time_as_well_as_on_steps(tmp_path, tiny_target):
    from test_extract import prepared_run

    cfg = prepared_run(
        tmp_path,
        tiny_target,
        n=24,
        train={**TRAIN, "max_steps": 3, "keep_last": 5, "warmup_steps": 5, "save_every_minutes": 1e-9},
    )
    with RunDir(cfg.run_dir).lock:
        row = pipeline.run_stage(cfg, "train")
    # a degenerate run says so: too few steps to finish the warmup, too few samples to generalise
    assert len(row["warnings"]) == 2, row["warnings"]
    assert "trained 3 steps, fewer than train.warmup_steps (5)" in row["warnings"][0]
    assert re.search(r"trained on \d+ samples \(fewer than 100\)", row["warnings"][1])
    names = sorted(p.name for p in (Path(cfg.run_dir) / "train" / "checkpoints").glob("step-*"))
    assert names == ["step-1", "step-2", "step-3"], "train.save_every is 100: these came from save_every_minutes"
    edited = cfg.model_copy(deep=True)
    edited.train.save_every_minutes = 60.0
    assert pipeline.fingerprint(edited, "train") == pipeline.fingerprint(cfg, "train"), "cadence is not a parameter"


# ------------------------------------------------------------------------------------ degenerate-run warnings


def test_prepare_warns_per_drop_cause_and_on_think_tags_left_in_replies(tmp_path, tiny_target, cli):
    from eaglekit.tiny.corpus import sample_tasks

    gen = tmp_path / "run" / "generate"
    gen.mkdir(parents=True)
    rows = []
    for i, t in enumerate(sample_tasks(20, 3, split="train")):
        row = {
            "id": f"r{i}",
            "messages": [{"role": "user", "content": t.prompt}],
            "reasoning": t.reasoning,
            "content": t.answer,
            "finish_reason": "stop",
        }
        if i < 3:  # 15 %: cut off at max_tokens
            row["finish_reason"] = "length"
        elif i == 3:  # 5 %: no reply (under the 10 % line: no warning for it)
            row["reasoning"] = row["content"] = ""
        elif i < 6:  # reasoning left inline: the server ran without its reasoning parser
            row["reasoning"], row["content"] = "", f"<think>{t.reasoning}</think>{t.answer}"
        rows.append(row)
    (gen / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(
        tmp_path / "c.yaml",
        {"run_dir": "run", "target": {"model": str(tiny_target)}, "data": {"prompts": "unused.jsonl"}},
    )
    r = cli("prepare", cfg, "--skip-preflight", "--json")
    assert r.code == 0, r.err
    warnings = json.loads(r.out)["warnings"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("3 of 20 responses (15%) dropped as cut off at generate.max_tokens")
    assert "raise generate.max_tokens" in warnings[0]
    assert warnings[1].startswith("2 of 20 replies keep think tags in their content")
    assert "prepare: warning: 3 of 20 responses (15%) dropped" in r.err
    rows = {r["stage"]: r for r in status.stage_rows(load_config(cfg))}
    assert rows["prepare"]["warnings"] == warnings


def test_training_curves_use_a_log_loss_axis_and_show_a_single_point(tmp_path):
    from eaglekit import plots

    rows = [
        {"kind": "train", "step": s, "loss": loss, "acc_k": [0.1, 0.05]}
        for s, loss in ((0, 17.8), (10, 2.0), (20, 1.4))
    ]
    fig = plots.training_curves(
        rows + [{"kind": "eval", "step": 20, "loss": 1.5, "acc_k": [0.4, 0.2]}], tmp_path / "c.png"
    )
    assert fig.axes[0].get_yscale() == "log", "the step-0 loss must not flatten the rest"
    one = plots.training_curves([{"kind": "eval", "step": 5, "loss": 2.0, "acc_k": [0.3]}], tmp_path / "one.png")
    assert all(line.get_marker() not in (None, "None", "") for line in one.axes[0].lines + one.axes[1].lines)
    assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cache_follows_eaglekit_cache_then_xdg_cache_home(tmp_path, monkeypatch):
    from eaglekit.tiny.build import cache_root

    monkeypatch.delenv("EAGLEKIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "eaglekit"
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("EAGLEKIT_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "eaglekit"


def test_a_moved_run_with_its_data_is_still_done(tmp_path, cli, fakes):
    """Fingerprints hash the content of input files, not their paths: moving the project keeps finished work."""
    from eaglekit.rundir import file_identity

    mods, _ = fakes
    mods["generate"].params = lambda run: {"prompts": file_identity(run.cfg.data.prompts)}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "prompts.jsonl").write_text('{"id": "1", "messages": [{"role": "user", "content": "hi"}]}\n')
    assert cli("run", config(tmp_path / "a")).code == 0
    (tmp_path / "a").rename(tmp_path / "b")
    rows = status.stage_rows(load_config(tmp_path / "b" / "c.yaml"))
    assert {r["state"] for r in rows} == {"done"}
    (tmp_path / "b" / "prompts.jsonl").write_text('{"id": "1", "messages": [{"role": "user", "content": "ho"}]}\n')
    rows = status.stage_rows(load_config(tmp_path / "b" / "c.yaml"))
    assert rows[0]["state"] == "stale" and rows[0]["reason"].startswith("generate.prompts: ")


@pytest.mark.parametrize(
    "errno_name, says, fix",
    [
        ("EACCES", "permission denied", "make the folder writable"),
        ("EIO", "I/O error", "check the disk or network volume"),
        ("EROFS", "read-only file system", "remount it read-write"),
    ],
)
def test_other_disk_faults_name_the_file_and_the_fix(tmp_path, cli, fakes, errno_name, says, fix):
    """As root these cannot be provoked for real (root writes through permissions; EIO needs a failing device):
    the stage raises the OSError a failing write would."""
    import errno as errnos

    mods, calls = fakes
    target = tmp_path / "run" / "prepare" / "tokens.safetensors"
    code = getattr(errnos, errno_name)
    mods["prepare"] = fake_stage("prepare", "generate", calls, fail=OSError(code, os.strerror(code), str(target)))
    r = cli("run", config(tmp_path))
    assert r.code == 1 and "Traceback" not in r.err
    text = " ".join(r.err.split())
    assert f"prepare: {says} writing {target}" in text and fix in text and "rerun the same command to resume" in text
    end = [e for e in ledger(tmp_path / "run") if e.get("stage") == "prepare" and e["event"] == "end"][-1]
    assert end["state"] == "failed" and end["reason"] == says


def test_a_check_that_raises_a_foreseen_error_is_a_plain_fail(tmp_path, cli, fakes):
    from eaglekit.errors import UsageError

    def estimate(ctx):
        raise UsageError(
            "drafter config: draft_vocab_size (32000) exceeds vocab_size (514)",
            "set vocab.draft_vocab_size to at most the target's vocabulary",
        )

    mods, _ = fakes
    mods["generate"].checks = lambda cfg: [estimate]
    r = cli("run", config(tmp_path))
    assert r.code == 1 and "Traceback" not in r.err
    assert "estimate: drafter config: draft_vocab_size (32000) exceeds vocab_size (514)" in " ".join(r.err.split())
    assert "set vocab.draft_vocab_size to at most" in r.err


def test_version_from_a_source_tree_without_installed_metadata(tmp_path):
    """`eaglekit --version` from sources on PYTHONPATH (no installed metadata) prints the version, no crash log."""
    import subprocess
    import sys

    from support.helpers import subprocess_env

    import eaglekit

    code = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "def version(name):\n"
        "    if name == 'eaglekit':\n"
        "        raise md.PackageNotFoundError(name)  # as in a source tree that was never installed\n"
        "    return real(name)\n"
        "md.version = version\n"
        "from eaglekit.cli import main\n"
        "main(['--version'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"eaglekit {eaglekit.__version__}"
    assert not list(tmp_path.rglob("*.log"))

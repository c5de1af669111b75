"""export: write the evaluated drafter in the forms vLLM and SGLang load, verify them, print how to serve them.

Writes under ``export/``: ``eagle3/`` (the legacy flat form: SGLang's ``--speculative-draft-model-path``
and vLLM's ``--speculative-config`` with ``method: eagle3``) and ``speculators/`` (``vllm serve DIR``),
each with ``model.safetensors``, ``config.json`` and the target's tokenizer files, and ``README.md``
(a model card with the serve commands and the evaluation's τ table).

Neither server complains about a missing, extra or mis-shaped weight, and a drafter whose RoPE or
``max_position_embeddings`` differ from the target's serves with poor acceptance without an error; so
every key and shape is validated before writing, the serving settings are checked against the target's
config, and each written folder is loaded back and must give the source checkpoint's logits exactly.
Each folder is written atomically. The flag names of the commands were read from vLLM's
``--speculative-config`` keys and SGLang's ``server_args.py``. The drafter's family writes its forms
(``EngineForms.write``: EAGLE-3's in ``drafters/eagle3/family.py``; a block drafter writes its one vLLM form,
``drafters/dflash/family.py``); the rest is this stage's, the same for every family: the model card
(``export/README.md``: the drafter, the run's inherited warnings, its data and training, evaluate's τ tables by K,
temperature and context group, verify's served figures when verify has run, the serve commands), the commands and
warnings printed, the counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data import eval_report, verify_report
from eaglekit.drafters.paths import checkpoint_path
from eaglekit.preflight import run_directory
from eaglekit.progress import console, human_bytes
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import file_identity
from eaglekit.training.checkpoint_integrity import EDITABLE

if TYPE_CHECKING:
    from eaglekit.drafters.family import Written

NAME = "export"
UPSTREAM = "evaluate"


def params(run: ResolvedRun) -> dict:
    cfg = run.cfg
    # the checkpoint's identity, not its path: a run directory copied elsewhere keeps its export done
    return {**cfg.export.model_dump(), "checkpoint": file_identity(checkpoint_path(cfg))}


def requested_forms(ctx: StageContext) -> list[str]:
    return list(ctx.options.get("formats") or ctx.cfg.export.formats)


def verifier_known(ctx: StageContext):
    from eaglekit.drafters.checked import drafter_family  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import as_check  # lazy: heavy (torch)

    return as_check("verifier", drafter_family(ctx.cfg).engine.verifier_check(ctx.cfg, requested_forms(ctx)))


def sglang_aux_layers(ctx: StageContext):
    from eaglekit.drafters.checked import drafter_family  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import as_check  # lazy: heavy (torch)

    return as_check("SGLang aux layers", drafter_family(ctx.cfg).engine.sglang_check(ctx.cfg, requested_forms(ctx)))


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight.drafter import drafter_checkpoint  # lazy: heavy (torch)
    from eaglekit.preflight.engine_features import exported_features_read  # lazy: heavy (torch)

    return [run_directory.target_folder, drafter_checkpoint, verifier_known, sglang_aux_layers, exported_features_read]


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """Two forms of the drafter plus tokenizer files: pre-flight weighs the checkpoint on disk, a plan the
    drafter the config implies (fp32)."""
    if sizes is None:
        path = checkpoint_path(ctx.cfg)
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
        return Estimate(bytes=2 * weights + (64 << 20))
    est = Estimate()
    drafter = drafter_bytes(ctx.cfg)
    if drafter is not None:
        est.bytes = 2 * drafter + (64 << 20)
        est.how.append(f"2 forms × {human_bytes(drafter)} drafter + tokenizer files")
    measured_time(est, sizes, None)
    return est


def drafter_bytes(cfg: RunConfig) -> int | None:
    """The fp32 weights of the drafter a fresh training run builds; None without the target's config.json."""
    from eaglekit.drafters.registry import parameter_counts  # lazy: heavy (torch)

    if not (Path(cfg.target.model) / "config.json").is_file():
        return None
    try:
        return 4 * parameter_counts(cfg)[0]
    except Exception:  # noqa: BLE001 - a config eaglekit cannot derive a drafter from: the preflight says why
        return None


def run(ctx: StageContext) -> dict:
    """The drafter's family writes its forms (``drafters/``: EAGLE-3's plain and speculators forms, a block
    drafter's vLLM form), each checked against the drafter it came from; the model card and the commands are this
    stage's."""
    from eaglekit.drafters.checked import drafter_family, load_checked_drafter  # lazy: heavy (torch)

    requested = list(dict.fromkeys(requested_forms(ctx)))
    written = drafter_family(ctx.cfg).engine.write(ctx, load_checked_drafter, requested)
    inherited = run_warnings(ctx)
    if inherited:
        ctx.warn(
            f"exported a drafter from a run with {len(inherited)} warning{'s' * (len(inherited) > 1)} (written "
            "anyway; export/README.md states them): " + " | ".join(inherited)
        )
    atomic.write_text(ctx.dir / "README.md", model_card(ctx, written, inherited))
    for what, command in written.commands:
        console.print(f"[bold]{what}[/]:")
        console.print(command, markup=False, soft_wrap=True)
    for w in written.warnings:
        console.print(f"[yellow]export: {w}[/]")
    folders = {form: str(folder) for form, folder in written.folders.items()}
    return {"formats": list(written.folders), **folders, "warnings": len(written.warnings)}


# ------------------------------------------------------------------------------------------- the model card


def run_warnings(ctx: StageContext) -> list[str]:
    """The warnings the stages before export recorded in their last finished run ("stage: text")."""
    events = ctx.run.last_events()
    out = []
    for stage in ctx.stages[: ctx.stages.index(ctx.stage)]:
        end = (events.get(stage) or {}).get("end") or {}
        if end.get("state") == "done":
            out += [f"{stage}: {w}" for w in end.get("warnings") or []]
    return out


def model_card(ctx: StageContext, written: Written, inherited: Sequence[str] = ()) -> str:
    """export/README.md, the page users publish with the drafter, for every family."""
    cfg = ctx.cfg
    lines = card_header(cfg, written)
    if inherited:
        lines += [
            "## Warnings: read before serving",
            "",
            "The run that made this drafter recorded these warnings; it was exported anyway:",
            "",
        ]
        lines += [f"- {w}" for w in inherited] + [""]
    lines += data_and_training(ctx)
    lines += [
        "## Acceptance (eaglekit evaluate, KV-cached draft → verify with the HF target)",
        "",
        "τ is what vLLM and SGLang should report at equal K (chain drafting, topk 1, up to numerics); the "
        "speedups are those of eaglekit's Hugging Face loop on the evaluation machine, not a serving engine's.",
        "",
    ]
    report = read_report(cfg.run_path / "evaluate" / "report.json")
    lines += [eval_report.report_markdown(report, tables_only=True)] if report else ["No evaluation report found."]
    served = read_report(cfg.run_path / "verify" / "report.json")
    if served:
        lines += ["", verify_report.card_markdown(served)]
    lines += serve_section(cfg, written)
    if written.warnings:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in written.warnings]
    return "\n".join(lines) + "\n"


def read_report(path: Path) -> dict | None:
    """A stage's report.json, or None when that stage has not written one."""
    return json.loads(path.read_text()) if path.exists() else None


def card_header(cfg: RunConfig, written: Written) -> list[str]:
    """The model card's title: the target, the drafter's shape, the checkpoint it came from."""
    from eaglekit.drafters.family import verifier_id  # lazy: heavy (torch)

    hub = verifier_id(cfg)
    return [
        f"# {written.title}",
        "",
        f"Target: `{cfg.target.model}`" + (f" (hub id `{hub}`)" if hub and hub != cfg.target.model else ""),
        f"Drafter: {written.drafter_line}.",
        f"Source checkpoint: `{written.info.path}`.",
        "",
    ]


def data_and_training(ctx: StageContext) -> list[str]:
    """What the ledger recorded of generate and prepare, and train's summary."""
    cfg, events = ctx.cfg, ctx.run.last_events()

    def stage_counts(stage: str) -> str:
        counts = (events.get(stage, {}).get("end") or {}).get("counts") or {}
        return ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, (dict, list))) or "not recorded"

    summary = read_report(cfg.run_path / "train" / "summary.json") or {}
    trained = (f"{summary.get('steps')} steps, {summary.get('tokens')} tokens" if summary else "not recorded") + (
        f", held-out simulated τ {summary['tau']:.3f}" if isinstance(summary.get("tau"), (int, float)) else ""
    )
    return [
        "## Data and training",
        "",
        f"- generate: {stage_counts('generate')}",
        f"- prepare: {stage_counts('prepare')}",
        f"- train: {trained}",
        "",
    ]


def serve_section(cfg: RunConfig, written: Written) -> list[str]:
    """The commands that serve the written forms, and what each form's folder holds."""
    lines = ["", "## Serve", ""]
    for what, command in written.commands:
        lines += [f"{what}:", "", "```bash", command, "```", ""]
    if cfg.target.chat_template:
        lines += [
            "The run used a chat template override (target.chat_template): pass the same template to the "
            "server (`--chat-template`), or the served prompts differ from the ones the drafter learned.",
            "",
        ]
    return lines + [f"- `{form}/`: {written.holds[form]}" for form in written.folders]


def damaged(ctx: StageContext) -> str | None:
    """A form whose weights are not the bytes export wrote (their digests: a flipped block, a partial copy) is
    written again from the checkpoint; seconds. A config.json edited by hand is left as it is (verify serves it)."""
    found = [
        str(d)
        for folder in atomic.damaged_folders(ctx.dir, depth=1).values()
        for d in folder
        if d.file.suffix not in EDITABLE
    ]
    return "; ".join(found) or None


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="the evaluated drafter and evaluate/report.json",
    writes="export/eagle3/, export/speculators/, export/README.md",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
    damaged=damaged,
)

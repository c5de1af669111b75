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
``--speculative-config`` keys and SGLang's ``server_args.py``. The drafter's family does the writing
(``drafters/eagle3.py``; a block drafter writes its one vLLM form, ``drafters/dflash.py``).
"""

from __future__ import annotations

from pathlib import Path

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.drafters.paths import checkpoint_path
from eaglekit.preflight import run_directory
from eaglekit.progress import human_bytes
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import file_identity
from eaglekit.training.checkpoint_integrity import EDITABLE

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

    return as_check("verifier", drafter_family(ctx.cfg).verifier_check(ctx.cfg, requested_forms(ctx)))


def sglang_aux_layers(ctx: StageContext):
    from eaglekit.drafters.checked import drafter_family  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import as_check  # lazy: heavy (torch)

    return as_check("SGLang aux layers", drafter_family(ctx.cfg).sglang_check(ctx.cfg, requested_forms(ctx)))


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
    drafter's vLLM form), each checked against the drafter it came from."""
    from eaglekit.drafters.checked import drafter_family, load_checked_drafter  # lazy: heavy (torch)

    return drafter_family(ctx.cfg).export(ctx, load_checked_drafter)


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

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
``--speculative-config`` keys and SGLang's ``server_args.py``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import torch

from eaglekit import atomic
from eaglekit.config import BLOCK_ARCHITECTURES, RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data.eval_report import report_markdown
from eaglekit.errors import EaglekitError
from eaglekit.model.run_shapes import drafter_config, parameter_counts
from eaglekit.preflight import checks as common
from eaglekit.preflight import fail, ok, warn
from eaglekit.preflight.checks import human_bytes
from eaglekit.preflight.drafter import drafter_checkpoint
from eaglekit.preflight.engine_features import exported_features_read
from eaglekit.progress import console
from eaglekit.rundir import file_identity
from eaglekit.serving.engine_features import export_check
from eaglekit.speculative.inputs import checkpoint_path, drafter_architecture, load_checked_drafter

NAME = "export"
UPSTREAM = "evaluate"


def params(cfg: RunConfig) -> dict:
    # the checkpoint's identity, not its path: a run directory copied elsewhere keeps its export done
    return {**cfg.export.model_dump(), "checkpoint": file_identity(checkpoint_path(cfg))}


def verifier_id(cfg: RunConfig) -> str:
    """What the speculators form names as verifier (``vllm serve DIR`` serves it): export.verifier, else the
    target itself (its hub id, or its local folder, which is only valid on this machine)."""
    return cfg.export.verifier or cfg.target.model


def local_verifier_warning(cfg: RunConfig) -> str | None:
    vid = verifier_id(cfg)
    if cfg.export.verifier or not Path(vid).exists():
        return None
    return (
        f"the speculators config names the local folder {vid} as verifier: `vllm serve DIR` works on this "
        "machine, but not for anyone you publish the drafter to; set export.verifier to the target's hub id "
        "before publishing"
    )


def verifier_known(ctx: StageContext):
    if drafter_architecture(ctx.cfg) in BLOCK_ARCHITECTURES:
        return ok("verifier", "block drafter: its vLLM form names no verifier (vLLM is given the target)")
    if "speculators" not in (ctx.options.get("formats") or ctx.cfg.export.formats):
        return ok("verifier", "speculators form not requested")
    if drafter_architecture(ctx.cfg) == "mla":
        return ok("verifier", "MLA drafter: only the plain form is written (no speculators form for MLA)")
    warning = local_verifier_warning(ctx.cfg)
    if warning:
        return warn("verifier", warning, "set export.verifier to the target's hub id (the rest is written either way)")
    return ok("verifier", f"speculators config names {verifier_id(ctx.cfg)}")


def forms_to_write(architecture: str, requested: list[str]) -> tuple[list[str], list[str]]:
    """(forms, warnings): an MLA drafter has only the plain form (checkpoints.NO_MLA_SPECULATORS)."""
    from eaglekit.model.checkpoints import NO_MLA_SPECULATORS

    if architecture != "mla" or "speculators" not in requested:
        return requested, []
    if requested == ["speculators"]:
        raise EaglekitError(
            f"export.formats is [speculators], but {NO_MLA_SPECULATORS}",
            "set export.formats: [eagle3] (the plain form, which vLLM and SGLang load)",
        )
    return [f for f in requested if f != "speculators"], [f"speculators form not written: {NO_MLA_SPECULATORS}"]


def sglang_aux_problem(cfg: RunConfig, formats: list[str]) -> str | None:
    """Why the legacy (SGLang) form cannot carry this run's aux layers, or None."""
    from eaglekit.model.checkpoints import SGLANG_AUX_RULE, sglang_aux_layer_ids

    aux = cfg.target.aux_layers
    if "eagle3" not in formats or aux is None or sglang_aux_layer_ids(aux) is not None:
        return None
    return (
        f"target.aux_layers {list(aux)} cannot be written for SGLang: {SGLANG_AUX_RULE}; only aux layers "
        f"starting at hidden_states[2] (written [1, ...]) mean the same layers in every SGLang version"
    )


def sglang_aux_layers(ctx: StageContext):
    if drafter_architecture(ctx.cfg) in BLOCK_ARCHITECTURES:
        return ok("SGLang aux layers", "block drafter: no SGLang form")
    formats: list[str] = ctx.options.get("formats") or list(ctx.cfg.export.formats)
    problem = sglang_aux_problem(ctx.cfg, formats)
    if problem and drafter_architecture(ctx.cfg) == "mla":
        return warn(
            "SGLang aux layers",
            f"{problem}; the MLA drafter's only form is written for vLLM alone (it reads "
            "the top-level hidden_states indices verbatim), without an SGLang command",
            MLA_SGLANG_AUX_REMEDY,
        )
    if problem:
        return fail("SGLang aux layers", problem, SGLANG_AUX_REMEDY)
    return ok(
        "SGLang aux layers",
        "legacy form not requested"
        if "eagle3" not in formats
        else "eagle_config ids mean the trained layers in every SGLang version",
    )


SGLANG_AUX_REMEDY = (
    "for vLLM export the speculators form alone (`eaglekit export CONFIG --format speculators`: vLLM "
    "reads hidden_states indices verbatim); for SGLang train with target.aux_layers starting at 2"
)
MLA_SGLANG_AUX_REMEDY = "serve it with vLLM; for SGLang train with target.aux_layers starting at 2"


def checks(cfg: RunConfig) -> list:
    return [common.target_folder, drafter_checkpoint, verifier_known, sglang_aux_layers, exported_features_read]


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
    if not (Path(cfg.target.model) / "config.json").is_file():
        return None
    try:
        return 4 * parameter_counts(drafter_config(cfg))[0]
    except Exception:  # noqa: BLE001 - a config eaglekit cannot derive a drafter from: the preflight says why
        return None


def serving_problems(drafter_cfg, hf) -> list[str]:
    """RoPE scaling must be the target's (check_compatible compares max_position_embeddings and rope_theta), and the
    engines must be able to load the drafter's layout at all."""
    from eaglekit.model import checkpoints
    from eaglekit.model.drafter import rope_from_config

    problems = checkpoints.serving_problems(drafter_cfg)
    _, scaling = rope_from_config(hf)
    if (drafter_cfg.rope_scaling or None) != (scaling or None):
        problems.append(f"rope_scaling: the drafter's is {drafter_cfg.rope_scaling}, the target's {scaling}")
    return problems


@torch.no_grad()
def same_logits(source, written_dir: Path) -> None:
    """Load ``written_dir`` back and require the source drafter's logits, bit for bit, on random inputs."""
    from eaglekit.model.checkpoints import load_drafter

    loaded, info = load_drafter(written_dir)
    if info.missing_embeddings:  # written without embed_tokens: servers take the target's, so must we
        loaded.embed_tokens.weight.copy_(source.embed_tokens.weight.to(loaded.embed_tokens.weight.dtype))
    g = torch.Generator().manual_seed(0)
    c = source.config
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=g)
    aux = torch.randn(1, 12, 3 * c.target_hidden_size, generator=g).to(source.fc.weight.dtype)
    positions = torch.arange(12)[None]
    want, _ = source(ids, source.fuse(aux), positions)
    got, _ = loaded(ids, loaded.fuse(aux.to(loaded.fc.weight.dtype)), positions)
    if got.dtype != want.dtype or not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item()
        raise EaglekitError(
            f"{written_dir}: loaded back, the drafter's logits differ from the source checkpoint's "
            f"(max abs difference {diff:g}, dtypes {got.dtype} vs {want.dtype})",
            "this is a bug in the exporter; keep the source checkpoint and report it",
        )


def exported_window(folder: Path) -> int | None:
    """The sliding window an exported EAGLE-3 folder's config.json asks vLLM for (None: full attention)."""
    from eaglekit.model.checkpoints import layer_window

    try:
        return layer_window(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def serve_commands(cfg: RunConfig, dirs: dict[str, Path], sglang: bool = True) -> list[tuple[str, str]]:
    """(what, command) pairs for the written forms; ``sglang`` False when SGLang would serve the drafter wrong."""
    k = cfg.export.num_speculative_tokens
    target = shlex.quote(verifier_id(cfg))
    out = []
    if "eagle3" in dirs:
        d = str(dirs["eagle3"].resolve())
        spec = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": k}, separators=(",", ":"))
        out.append(("vLLM, legacy form", f"vllm serve {target} --speculative-config {shlex.quote(spec)}"))
    if "eagle3" in dirs and sglang:
        # SGLang takes a drafter's window from its command line, not from the checkpoint (sglang#24664)
        window = exported_window(dirs["eagle3"])
        out.append(
            (
                "SGLang, legacy form (chain of K drafts: topk 1, K+1 draft tokens)",
                f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {shlex.quote(d)} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
                + (f" --speculative-draft-window-size {window}" if window else ""),
            )
        )
    if "speculators" in dirs:
        d = shlex.quote(str(dirs["speculators"].resolve()))
        out.append(("vLLM, speculators form (the target comes from its config)", f"vllm serve {d}"))
    return out


def run(ctx: StageContext) -> dict:
    from eaglekit.data.chat import load_tokenizer
    from eaglekit.model.checkpoints import sglang_ignores
    from eaglekit.model.target import embedding_and_head

    cfg, xc = ctx.cfg, ctx.cfg.export
    if drafter_architecture(cfg) in BLOCK_ARCHITECTURES:  # the block-drafter family: one form, vLLM's
        return export_block_drafter(ctx)
    requested = list(dict.fromkeys(ctx.options.get("formats") or xc.formats))
    sglang_aux = sglang_aux_problem(cfg, requested)
    if sglang_aux and drafter_architecture(cfg) != "mla":  # a Llama drafter has the speculators form for vLLM
        raise EaglekitError(f"export: {sglang_aux}", SGLANG_AUX_REMEDY)
    drafter, info, hf, _ = load_checked_drafter(cfg)
    problems = serving_problems(drafter.config, hf)
    if problems:
        raise EaglekitError(
            f"drafter {info.path} does not serve like the target {cfg.target.model}: " + "; ".join(problems),
            "retrain the drafter with this target's config (its RoPE settings are copied at train time)",
        )
    formats, warnings = forms_to_write(drafter.config.architecture, requested)
    warnings += export_check(cfg, drafter.config, formats)  # refuses a feature the installed engine would drop
    ignored = sglang_ignores(drafter.config)
    if ignored:
        warnings.append(
            f"no SGLang command: SGLang's llama_eagle3.py / kimi_k25_eagle3.py do not read "
            f"{', '.join(ignored)} and would serve this drafter as if they were off; serve it with vLLM"
        )
    if sglang_aux:  # an MLA drafter: its plain form goes without eagle_config, for vLLM alone
        warnings.append(f"no SGLang command: {sglang_aux}; vLLM reads the top-level hidden_states indices verbatim")
    verifier_warning = local_verifier_warning(cfg) if "speculators" in formats else None
    if verifier_warning:
        warnings.append(verifier_warning)
    if info.missing_embeddings and xc.include_embeddings:
        embed, _ = embedding_and_head(cfg.target.model, cfg.target.trust_remote_code)
        drafter.embed_tokens.weight.data.copy_(embed.to(drafter.embed_tokens.weight.dtype))
    drafter.eval()
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    dirs = write_forms(ctx, drafter, hf, tokenizer, formats, warnings)
    commands = serve_commands(cfg, dirs, sglang=not (ignored or sglang_aux))
    inherited = run_warnings(ctx)
    if inherited:
        ctx.warn(
            f"exported a drafter from a run with {len(inherited)} warning{'s' * (len(inherited) > 1)} (written "
            "anyway; export/README.md states them): " + " | ".join(inherited)
        )
    atomic.write_text(ctx.dir / "README.md", model_card(ctx, drafter, info, list(dirs), commands, warnings, inherited))
    for what, command in commands:
        console.print(f"[bold]{what}[/]:")
        console.print(command, markup=False, soft_wrap=True)
    for w in warnings:
        console.print(f"[yellow]export: {w}[/]")
    return {"formats": list(dirs), **{form: str(d) for form, d in dirs.items()}, "warnings": len(warnings)}


def write_forms(ctx: StageContext, drafter, hf, tokenizer, formats: list[str], warnings: list[str]) -> dict[str, Path]:
    """Each form in its folder, swapped in whole once its keys, shapes and logits are checked; a form's warning
    is added to ``warnings``."""
    from eaglekit.model.checkpoints import save_legacy, save_speculators

    xc, verifier = ctx.cfg.export, verifier_id(ctx.cfg)
    dirs: dict[str, Path] = {}
    for form in formats:
        dest = ctx.dir / form
        with atomic.atomic_dir(dest) as tmp:
            # save_* write atomically themselves: into our (empty) temp folder, which is swapped in whole below
            if form == "eagle3":
                save_legacy(drafter, tmp, include_embeddings=xc.include_embeddings)
            else:
                warning = save_speculators(
                    drafter,
                    tmp,
                    verifier,
                    getattr(hf, "architectures", None),
                    xc.num_speculative_tokens,
                    include_embeddings=xc.include_embeddings,
                )
                if warning:
                    warnings.append(warning.replace(str(tmp), str(dest)))
            tokenizer.save_pretrained(tmp)
            same_logits(drafter, tmp)
        dirs[form] = dest
        console.print(f"export: {form} form written to {dest} (keys, shapes and logits checked)")
    return dirs


def export_block_drafter(ctx) -> dict:
    """A DFlash or DSpark drafter in the form vLLM 0.32 serves (``model/dflash_checkpoint.py``,
    ``model/dspark_checkpoint.py``), re-read and compared."""
    from eaglekit.data.chat import load_tokenizer
    from eaglekit.model import dflash_checkpoint, dspark_checkpoint
    from eaglekit.model.dspark import DSparkDrafter

    cfg = ctx.cfg
    drafter, info, _, _ = load_checked_drafter(cfg)
    dspark = isinstance(drafter, DSparkDrafter)
    form = dspark_checkpoint.FORM if dspark else dflash_checkpoint.FORM
    dest = ctx.dir / form
    export_check(cfg, drafter.config, [form])  # refuses a form the installed engine would serve wrong
    with atomic.atomic_dir(dest) as tmp:
        if dspark:
            dspark_checkpoint.save_dspark(drafter, tmp)
        else:
            dflash_checkpoint.save_dflash(drafter, tmp)
        again = dspark_checkpoint.load_block_for_target(tmp, cfg.target.model, cfg.target.trust_remote_code)
        mine, read = drafter.state_dict(), again.state_dict()
        if mine.keys() != read.keys() or any(not torch.equal(mine[k], read[k].to(mine[k])) for k in mine):
            raise EaglekitError(f"export: {dest} does not read back as the drafter written", "report this bug")
        load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code).save_pretrained(tmp)
    k = cfg.export.num_speculative_tokens
    commands = [(f"vLLM (method {form})", dflash_checkpoint.serve_command(verifier_id(cfg), dest, k, method=form))]
    warnings = []
    trained = drafter.config.block_size - (0 if dspark else 1)  # DSpark's anchor slot drafts too
    if k > trained:
        warnings.append(
            f"export.num_speculative_tokens {k} exceeds the {trained} draft slots the drafter was trained with"
        )
    problem = None if dspark else dflash_checkpoint.cpu_build_problem(drafter.state_dict(), drafter.config)
    if problem:
        warnings.append(
            f"on vLLM's CPU build: {problem} (train with train.draft.shared_k_norm: true to serve it there)"
        )
    if dspark:
        warnings.append(
            "vLLM's CPU build does not serve DSpark (its V1 model runner refuses the method); serve it with a GPU "
            "build of vLLM >= 0.32"
        )
    atomic.write_text(
        ctx.dir / "README.md",
        f"# {'DSpark' if dspark else 'DFlash'} drafter\n\n"
        f"From {info.path}; {drafter.config.num_hidden_layers} layers, block "
        f"{drafter.config.block_size}, aux layers {drafter.config.aux_layer_ids}.\n\n"
        + "".join(f"{what}:\n\n    {command}\n\n" for what, command in commands)
        + "".join(f"- warning: {w}\n" for w in warnings),
    )
    console.print(f"export: {form} form written to {dest} (keys, shapes and weights checked)")
    for what, command in commands:
        console.print(f"[bold]{what}[/]:")
        console.print(command, markup=False, soft_wrap=True)
    for w in warnings:
        console.print(f"[yellow]export: {w}[/]")
    return {"formats": [form], form: str(dest), "warnings": len(warnings)}


def run_warnings(ctx: StageContext) -> list[str]:
    """The warnings the stages before export recorded in their last finished run ("stage: text")."""
    events = ctx.run.last_events()
    out = []
    for stage in ctx.stages[: ctx.stages.index(NAME)]:
        end = (events.get(stage) or {}).get("end") or {}
        if end.get("state") == "done":
            out += [f"{stage}: {w}" for w in end.get("warnings") or []]
    return out


def model_card(
    ctx,
    drafter,
    info,
    formats: list[str],
    commands: list[tuple[str, str]],
    warnings: list[str],
    inherited: Sequence[str] = (),
) -> str:
    cfg, c = ctx.cfg, drafter.config
    report_path = cfg.run_path / "evaluate" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    lines = card_header(cfg, c, info)
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
    lines += [report_markdown(report, tables_only=True)] if report else ["No evaluation report found."]
    lines += serve_section(cfg, c, formats, commands)
    if warnings:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in warnings]
    return "\n".join(lines) + "\n"


def card_header(cfg: RunConfig, c, info) -> list[str]:
    """The model card's title: the target, the drafter's shape, the checkpoint it came from."""
    hub = verifier_id(cfg)
    return [
        "# EAGLE-3 drafter",
        "",
        f"Target: `{cfg.target.model}`" + (f" (hub id `{hub}`)" if hub and hub != cfg.target.model else ""),
        f"Drafter: one decoder layer ({describe_layer(c)}), hidden {c.hidden_size}, draft vocab {c.draft_vocab_size} "
        f"of {c.vocab_size}, "
        f"aux hidden states {c.aux_layer_ids or 'default [2, N//2, N-3]'} (HF hidden_states indices), "
        f"max_position_embeddings {c.max_position_embeddings}, rope_theta {c.rope_theta:g}"
        + (f", rope_scaling {c.rope_scaling}" if c.rope_scaling else "")
        + ".",
        f"Source checkpoint: `{info.path}`.",
        "",
    ]


def data_and_training(ctx: StageContext) -> list[str]:
    """What the ledger recorded of generate and prepare, and train's summary."""
    cfg, events = ctx.cfg, ctx.run.last_events()

    def stage_counts(stage: str) -> str:
        counts = (events.get(stage, {}).get("end") or {}).get("counts") or {}
        return ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, (dict, list))) or "not recorded"

    summary_path = cfg.run_path / "train" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
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


def serve_section(cfg: RunConfig, c, formats: list[str], commands: list[tuple[str, str]]) -> list[str]:
    """The commands that serve the written forms, and what each form's folder holds."""
    lines = ["", "## Serve", ""]
    for what, command in commands:
        lines += [f"{what}:", "", "```bash", command, "```", ""]
    if cfg.target.chat_template:
        lines += [
            "The run used a chat template override (target.chat_template): pass the same template to the "
            "server (`--chat-template`), or the served prompts differ from the ones the drafter learned.",
            "",
        ]
    described = {
        "eagle3": (
            "plain DeepSeek-V2 config (`Eagle3DeepseekV2ForCausalLM`), `layers.0.` keys"
            if c.architecture == "mla"
            else "legacy flat Llama config (`LlamaForCausalLMEagle3`), `midlayer.` keys"
        ),
        "speculators": "speculators config (`speculators_model_type: eagle3`), `layers.0.` keys",
    }
    return lines + [f"- `{f}/`: {described[f]}" for f in formats]


def describe_layer(c) -> str:
    from eaglekit.model.drafter import FLAGS

    if c.architecture == "mla":
        layer = (
            f"multi-head latent attention: {c.num_attention_heads} heads, q_lora_rank {c.q_lora_rank}, "
            f"kv_lora_rank {c.kv_lora_rank}, qk {c.qk_nope_head_dim}+{c.qk_rope_head_dim}, v {c.v_head_dim}"
        )
    else:
        layer = f"Llama attention: {c.num_attention_heads} heads, {c.num_key_value_heads} KV heads of {c.head_dim}"
    flags = [name for name in FLAGS if getattr(c, name)]
    return layer + (f"; {', '.join(flags)}" if flags else "")


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="the evaluated drafter and evaluate/report.json",
    writes="export/eagle3/, export/speculators/, export/README.md",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
)

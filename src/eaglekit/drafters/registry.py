"""The drafter families eaglekit trains, one line each (as vLLM registers its speculative models): the one place
the stages, the training loop, checkpointing and decoding learn which family a config or a folder holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.config import DEFAULT_ARCHITECTURE, RunConfig
from eaglekit.drafters.dflash.family import DFLASH
from eaglekit.drafters.dflash2.family import DFLASH2
from eaglekit.drafters.dspark.family import DSPARK
from eaglekit.drafters.eagle3.llama import EAGLE3_LLAMA
from eaglekit.drafters.eagle3.mla import EAGLE3_MLA
from eaglekit.drafters.family import DrafterFamily
from eaglekit.drafters.peagle.family import PEAGLE
from eaglekit.errors import UsageError
from eaglekit.model.run_shapes import target_and_aux

# in the order a drafter folder is recognised (family_of_folder): a family whose folders another family's reader
# also accepts goes before that family
FAMILIES: dict[str, DrafterFamily] = {
    "peagle": PEAGLE,  # parallel EAGLE-3 (its plain folders are EAGLE-3's with a slot token)
    "llama": EAGLE3_LLAMA,  # EAGLE-3, Llama layer: the default
    "mla": EAGLE3_MLA,  # EAGLE-3, DeepSeek-V3/Kimi layer
    "dflash": DFLASH,  # block drafter
    "dspark": DSPARK,  # DFlash's backbone and a Markov head
    "dflash2": DFLASH2,  # DFlash with convolutions and a path selector
}


def family_named(name: str | None) -> DrafterFamily:
    """The family a train.draft.architecture value names (None: the default)."""
    try:
        return FAMILIES[name or DEFAULT_ARCHITECTURE]
    except KeyError:
        raise UsageError(
            f"train.draft.architecture '{name}' is not a drafter family", f"use one of {', '.join(FAMILIES)}"
        ) from None


def family_of_folder(folder: str | Path | None) -> DrafterFamily | None:
    """The family whose checkpoint a drafter folder holds, or None (no folder, or none of theirs)."""
    if folder is None:
        return None
    return next((family for family in FAMILIES.values() if family.reading.reads_folder(Path(folder))), None)


def family_of_run(cfg: RunConfig) -> DrafterFamily:
    """The family a training run trains: train.init_from's when it names a folder of one, else the configured one."""
    return family_of_folder(cfg.train.init_from) or family_named(cfg.train.draft.architecture)


def fresh_drafter_config(cfg: RunConfig) -> Any:
    """The drafter config a fresh training run builds: shaped after the target, ``train.draft`` overriding."""
    hf, aux = target_and_aux(cfg)
    return family_named(cfg.train.draft.architecture).sizing.drafter_config(cfg, hf, aux)


def parameter_counts(cfg: RunConfig) -> tuple[int, int]:
    """(all parameters, trainable ones) of the drafter a fresh training run builds."""
    return family_named(cfg.train.draft.architecture).sizing.parameter_counts(fresh_drafter_config(cfg))


def family_of_drafter(drafter: Any) -> DrafterFamily:
    """The family of a loaded drafter (the first that builds its class: the EAGLE-3 families share theirs)."""
    return next(f for f in FAMILIES.values() if type(drafter) is f.drafter_class)


def proposer_for(drafter: Any, aux: list[int] | None = None) -> Any:
    """The ``speculative.decode.Proposer`` that drafts with a loaded drafter."""
    return family_of_drafter(drafter).reading.proposer(drafter, aux)


def vllm_method(form: str) -> str:
    """vLLM's --speculative-config method for an exported form."""
    family = next((f for f in FAMILIES.values() if form in f.engine.forms), EAGLE3_LLAMA)
    return family.engine.vllm_method(form)


def vllm_speculative_config(form: str, folder: Path, k: int) -> dict[str, Any]:
    """vLLM's --speculative-config serving ``folder`` (a written ``form``) with K drafts: the method, the model, K and
    the keys its family adds (P-EAGLE's plain form: parallel_drafting, which nothing in its config.json turns on)."""
    family = family_of_folder(folder) or next((f for f in FAMILIES.values() if form in f.engine.forms), EAGLE3_LLAMA)
    keys = {
        "method": family.engine.vllm_method(form),
        "model": str(Path(folder).resolve()),
        "num_speculative_tokens": k,
    }
    return keys | family.engine.vllm_options(form)

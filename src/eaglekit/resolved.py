"""A run resolved once: what a config comes to once the target, the prepared documents and the rules have been read.

A config says ``sliding_window: auto``, ``aux_layers`` unset, ``spool_gb: 4``; a command needs the window auto chose
and why, the layers the drafter taps, the bytes the spool may hold. ``ResolvedRun`` derives each of those once per
command, the first time a reader asks, and every reader — plan, pre-flight, train, export, the ledger, `status`, and
each stage's fingerprint (``Stage.params``) — reads it from there: a derived value has one definition and is computed
at one place, so plan, pre-flight and train say the same window for the same reason.

The pipeline resolves a run afresh for each stage it runs (``pipeline.make_context``): a stage reads what the stages
before it wrote in the same command (auto's window reads the documents prepare wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from eaglekit.config import FeatureStreamConfig, RunConfig, VllmFeaturesConfig
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model import sliding_window
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.sliding_window import ServedContext, TrainingLengths, WindowChoice
from eaglekit.model.target_config import target_context

GB = 1e9  # the config's sizes are decimal gigabytes


@dataclass(frozen=True)
class FeatureSource:
    """The vLLM feature servers a run reads hidden states from (extract.backend vllm), as every reader needs them."""

    servers: VllmFeaturesConfig  # extract.vllm
    stream: FeatureStreamConfig  # extract.stream
    target_model: str  # the target the servers load (target.model)
    served_model: str  # the model name the servers serve: extract.vllm.model, else the target's
    through_mooncake: bool  # the states come through the Mooncake store, not files in storage_path
    spool_bytes: float  # what the servers' files (or Mooncake objects) of the run may hold at once


class ResolvedRun:
    """One config, resolved: each figure is read and each rule applied the first time it is asked for, then kept."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @property
    def family(self) -> str:
        """The drafter family's name (train.draft.architecture, else the default's)."""
        return self.cfg.train.draft.family

    @cached_property
    def target_and_aux(self) -> tuple[Any, list[int]]:
        """(the target's HF text config, the aux layer ids the drafter taps); raises where the target's config is
        unreadable or the aux layers do not fit its depth (its pre-flight check names that)."""
        return target_and_aux(self.cfg)

    @property
    def aux_layers(self) -> list[int]:
        return self.target_and_aux[1]

    @cached_property
    def max_position_embeddings(self) -> int | None:
        """The target's context (vLLM's default max_model_len); None where its config does not say or is unreadable
        (a config transformers refuses, e.g. zero heads, is the target pre-flight check's to name: train's
        fingerprint, which asks here first, must not crash on it)."""
        try:
            return target_context(self.cfg.target)
        except (EaglekitError, ValueError, ArithmeticError, OSError):
            return None

    @cached_property
    def served(self) -> ServedContext | None:
        """The context the drafter will be served at, and where that figure comes from."""
        return sliding_window.served_context(self.cfg.evaluate.context_lengths, self.max_position_embeddings)

    @cached_property
    def lengths(self) -> TrainingLengths | None:
        """The training documents' lengths (prepare.max_length until prepare has written them)."""
        return sliding_window.training_lengths(self.cfg)

    @cached_property
    def window(self) -> WindowChoice:
        """The sliding window a fresh drafter trains with, and why (model/sliding_window.py)."""
        return sliding_window.draft_window(self.cfg, self)

    @property
    def spool_bytes(self) -> float:
        """extract.stream.spool_gb in bytes: what a streamed run's servers may hold for it at once."""
        return self.cfg.extract.stream.spool_gb * GB

    @property
    def cache_bytes(self) -> float:
        """extract.stream.cache_gb in bytes: the streamed features kept in memory across epochs."""
        return self.cfg.extract.stream.cache_gb * GB

    @cached_property
    def feature_source(self) -> FeatureSource:
        """The vLLM feature servers' settings (extract.backend vllm; parse_config requires extract.vllm there)."""
        servers = self.cfg.extract.vllm
        if servers is None:
            raise UsageError(
                "extract.backend is 'vllm' but extract.vllm is not set", "add extract.vllm: {servers: [...]}"
            )
        return FeatureSource(
            servers=servers,
            stream=self.cfg.extract.stream,
            target_model=self.cfg.target.model,
            served_model=servers.model or self.cfg.target.model,
            through_mooncake=self.cfg.extract.through_mooncake,
            spool_bytes=self.spool_bytes,
        )

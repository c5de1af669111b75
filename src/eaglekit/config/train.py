"""``train``: the optimizer, schedule, batches and checkpoints, with the drafter (``train.draft``, draft.py) and
EAGLE-3's training-time test (``train.ttt``, ttt.py) below it; the flat TTT keys of before train.ttt still load."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, model_validator

from eaglekit.config.base import DtypeAlias, Section, Seed, move_old_spellings
from eaglekit.config.draft import DraftConfig, DraftSection, LlamaDraft
from eaglekit.config.paths import PATH_OR_HUB_ID
from eaglekit.config.ttt import TTT_ONLY_KEYS, TTTConfig
from eaglekit.divergences import LKHybrid

# train keys that moved under train.ttt, by their old spelling: they load, with a ConfigDeprecation naming both
TTT_MOVED = {
    "ttt_steps": "ttt.steps",
    "ttt_decay": "ttt.decay",
    "loss": "ttt.loss",
    "lk_eta": "ttt.loss.eta",  # lk_hybrid's own parameter: beside another loss it is refused, naming lk_hybrid
    **{key: f"ttt.{key}" for key in ("step_weights", "loss_normalization", "noise", "noise_scale", "anchor_weight",
                                     "activation_checkpointing", "attention", "head_loss", "compile")},
}  # fmt: skip


def move_old_train_spellings(data: Any) -> Any:
    """A train section's raw keys with the flat TTT spellings (TTT_MOVED) moved under train.ttt: a config, and the
    train parameters a run directory's ledger recorded before train.ttt (stages/train.py reads them through it)."""
    if isinstance(data, dict) and data.get("lk_eta") == LKHybrid().eta and data.get("loss") != LKHybrid().name:
        # a config eaglekit wrote before (RUN_DIR/config.yaml) holds the default lk_eta beside every loss: it
        # asked nothing there, so it is dropped rather than refused as another loss's parameter
        data = {key: value for key, value in data.items() if key != "lk_eta"}
    return move_old_spellings(data, TTT_MOVED, "train")


D = TypeVar("D", bound=DraftSection)


# AdamW's betas before train.adam_betas existed (the EAGLE reference's): a run that resolves to them keeps the train
# fingerprint it had then, so a drafter finished before the key was added is not made stale by it
LEGACY_ADAM_BETAS = (0.9, 0.95)


class TrainConfig(Section):
    init_from: Annotated[str | None, PATH_OR_HUB_ID] = Field(
        None,
        description="published drafter to finetune (legacy or speculators form): a "
        "folder, or a hub id (org/name[@revision]) that pre-flight downloads",
    )
    remap_vocab: bool = False
    draft: DraftConfig = Field(default_factory=LlamaDraft)
    ttt: TTTConfig = Field(default_factory=TTTConfig)
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw on every parameter, or muon (torch.optim.Muon: momentum 0.95, weight decay "
        "muon_weight_decay, 5 Newton-Schulz steps, update RMS matched to AdamW's) on the drafter's 2-D "
        "weights and AdamW on the rest (norms, embeddings, head), as speculators ships",
    )
    muon_weight_decay: float = Field(0.1, ge=0.0, description="optimizer muon: weight decay of the Muon group")
    early_stop_patience: int | None = Field(
        None,
        ge=1,
        description="end the run after this many held-out evaluations in a row in which simulated τ fell while the "
        "held-out loss fell (training/early_stop.py); None: only warn, after 3",
    )
    lr: float = Field(1e-4, gt=0.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    warmup_steps: int = Field(50, ge=0)
    adam_betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999),
        description="AdamW's (beta1, beta2): of every parameter (optimizer adamw), of the non-Muon group (muon). "
        "Before this key eaglekit trained with [0.9, 0.95] (the EAGLE reference's): set that to keep a run's finished "
        "drafter done",
    )
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(0.5, gt=0.0)
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    epochs: float = Field(1.0, gt=0.0)
    eval_every: int = Field(100, ge=1)
    eval_samples: int | None = Field(512, ge=1, description="held-out samples per evaluation (None: all of them)")
    log_every: int = Field(10, ge=1, description="optimizer steps per line in train/metrics.jsonl")
    report_to: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] | None = Field(
        None,
        description="experiment trackers each metrics.jsonl line also goes to, with the run's config and resolved "
        "plan, and evaluate's and verify's τ tables and plots (docs/trackers.md); each an optional extra "
        "(pip install 'eaglekit[trackio]'). None: those installed and configured (TensorBoard; wandb with "
        "WANDB_API_KEY or WANDB_MODE=offline; MLflow with MLFLOW_TRACKING_URI; trackio with a TRACKIO_ variable); "
        "[]: none",
    )
    save_every: int = Field(500, ge=1)
    save_every_minutes: float | None = Field(
        30.0, gt=0, description="also checkpoint when this much time has passed since the last one (None: steps only)"
    )
    keep_last: int = Field(2, ge=1)
    packing: bool = Field(
        False,
        description="several samples per row (per-document attention masks): fewer, fuller "
        "rows when sample lengths vary",
    )
    pack_length: int | None = Field(
        None, ge=8, description="packing: tokens per row (default prepare.max_length); batch_size counts rows"
    )
    seed: Seed = 0
    dtype: Annotated[Literal["auto", "float32", "bfloat16"], DtypeAlias] = "auto"
    distributed: Literal["ddp", "fsdp"] = "ddp"
    init_lm_head_from_target: bool = True
    freeze_lm_head: bool = Field(
        True,
        description="keep the draft head at the rows it starts from (the target's lm_head rows, or the init_from "
        "drafter's), as speculators does; false trains it too. A head with no rows to start from "
        "(the target's are another width, or init_lm_head_from_target false) always trains",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="ranks that split each row's positions (training/context_parallel.py): each holds 1/N of the row's "
        "features and activations and all-gathers the keys, so a row of tens of thousands of tokens trains across N "
        "GPUs (docs/long-context.md); under torchrun with a multiple of N processes (the rest is data parallel); "
        "every drafter family (EAGLE-3's TTT step, DFlash's and DSpark's blocks), offline features",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        return move_old_train_spellings(data)

    def draft_as(self, model: type[D]) -> D:
        """train.draft as the family whose model is ``model`` reads it: the section itself when it is that family's
        (or one extending it), else the keys the two share (a finetune whose train.init_from holds another family
        than train.draft.architecture names)."""
        if isinstance(self.draft, model):
            return self.draft
        shared = (type(self.draft).model_fields.keys() & model.model_fields.keys()) - {"architecture"}
        return model(**{key: getattr(self.draft, key) for key in shared})

    @model_validator(mode="after")
    def _ttt_keys_need_ttt(self) -> TrainConfig:
        """The TTT objective's settings do nothing for a family that trains another objective (a block drafter's is
        drafters/dflash/objective.py's): one set away from its default is refused rather than ignored."""
        objective = self.draft.objective_without_ttt
        if objective is None:
            return self
        fields = TTTConfig.model_fields
        set_keys = [
            name
            for name in TTT_ONLY_KEYS
            if name in self.ttt.model_fields_set
            and getattr(self.ttt, name) != fields[name].get_default(call_default_factory=True)
        ]
        if set_keys:
            raise ValueError(
                f"train.ttt's {', '.join(set_keys)}: EAGLE-3's training-time-test settings; architecture "
                f"{self.draft.family} trains {objective}, which does not read them: remove them"
            )
        return self

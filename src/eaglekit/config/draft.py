"""``train.draft``: one model per drafter family, each with only the keys that family reads, picked by
``architecture``.

A new family is its model here (a ``DraftSection`` subclass, or one of a family it extends, with its
``architecture`` Literal) and its line in ``DRAFT_MODELS``; ``drafters/registry.FAMILIES`` names the same families
(config is layer 0 and cannot ask the registry; tests/drafters/test_drafter_registry.py holds the two tables to the same
names)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    SerializationInfo,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from eaglekit.config.base import Section

DEFAULT_ARCHITECTURE = "llama"  # train.draft.architecture unset
AUTO: Literal["auto"] = "auto"  # train.draft.sliding_window's default, resolved by model/sliding_window.py


def _window_off(value: Any) -> Any:
    """YAML reads an unquoted off/false/no as False: each says "no window", as null and the word none do."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none")):
        return None
    if value is True:
        raise ValueError("true is not a window: write auto, a number of positions (e.g. 2048) or null (none)")
    return value


# train.draft.sliding_window of the families that take a window: auto (the default), a window, or None
WindowSetting = Annotated[Annotated[int, Field(ge=2)] | Literal["auto"] | None, BeforeValidator(_window_off)]
AUTO_WINDOW = (
    "; auto (the default): when the drafter is served 4x or more beyond its training documents' median "
    "length (evaluate.context_lengths, else a long target's max_position_embeddings), a window of the largest power "
    "of two no longer than half that length, at most 2,048, else none (model/sliding_window.py); null or off: no window"
)


class DraftSection(Section):
    """``train.draft``: the drafter's layer and flags, every shape defaulting to the target's. Each drafter family
    has its model below with only the keys it reads (the keys every family reads are these); ``architecture``
    picks the model (``DraftConfig``), and a key of another family is refused as the config loads, naming the
    families that read it."""

    architecture: str | None = None  # each family's model narrows it to its name

    intermediate_size: int | None = Field(None, ge=1, description="the MLP's width (default: the target's)")
    num_attention_heads: int | None = Field(None, ge=1, description="attention heads (default: the target's)")

    # What the family trains, for the train section's checks (config is layer 0: it cannot ask drafters/registry).
    # The objective it trains instead of EAGLE-3's training-time test, which then reads none of train.ttt's
    # settings (None: it trains TTT).
    objective_without_ttt: ClassVar[str | None] = None
    # Whether it drafts over a draft vocabulary of its own (the vocab stage's d2t/t2d, train.remap_vocab's mapping)
    # rather than the target's whole one.
    has_draft_vocab: ClassVar[bool] = True

    @property
    def family(self) -> str:
        """Its family's name: train.draft.architecture, or the default's when unset."""
        return self.architecture or DEFAULT_ARCHITECTURE

    @property
    def window(self) -> int | Literal["auto"] | None:
        """train.draft.sliding_window as written (auto, a window or None), None where the family has no such key:
        model/sliding_window.draft_window says what a fresh drafter attends."""
        return getattr(self, "sliding_window", None)

    @model_validator(mode="before")
    @classmethod
    def _keys_of_its_family(cls, data: Any) -> Any:
        """A key of another family would do nothing here: refused, naming the families that read it. Left null or
        false it asks nothing (and a RUN_DIR/config.yaml holds every family's keys): dropped. A key no family has
        is left to the unknown-key error."""
        if not isinstance(data, dict):
            return data
        foreign = [key for key in data if key not in cls.model_fields and key in every_draft_key()]
        # auto asks nothing either: a family without the choice has it decided (no window)
        stray = sorted(key for key in foreign if data[key] is not None and data[key] is not False and data[key] != AUTO)
        if stray:
            raise ValueError(_not_read(cls.model_fields["architecture"].default or DEFAULT_ARCHITECTURE, stray))
        return {key: value for key, value in data.items() if key not in foreign}

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self).model_fields and name in every_draft_key():  # as it is refused when it loads
            raise ValueError(_not_read(self.family, [name]))
        super().__setattr__(name, value)

    @model_serializer(mode="wrap")
    def _every_familys_keys(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """A dump names every family's keys, null where this family has none, as before train.draft was shaped
        by family: a RUN_DIR/config.yaml reads the same, and train's fingerprint of a run trained before is
        unchanged (it is not made stale by the upgrade)."""
        own = handler(self)
        if not isinstance(own, dict) or info.exclude_none:
            return own
        keys = [*every_draft_key(), *own]
        return {key: own.get(key) for key in dict.fromkeys(keys) if key in own or key not in type(self).model_fields}


class Eagle3Draft(DraftSection):
    """The keys both EAGLE-3 families (one decoder layer, trained with training-time test) read. The EAGLE 3.1
    flags are named as vLLM, SGLang and speculators name them."""

    hidden_size: int | None = Field(
        None,
        ge=1,
        description="the layer's width (default: the target's); another width than the target's means the drafter "
        "learns its own embedding",
    )
    fc_norm: bool | None = Field(
        None,
        description="EAGLE 3.1: an RMSNorm per aux hidden state before fc (weights fc_norm.{0,1,2}), so the tapped "
        "layers enter the fusion at one scale whatever their depth; read by vLLM and SGLang; default on for "
        "architecture llama since the τ race (+17.8 % τ at K=5, docs/recipe.md), off for mla",
    )
    norm_output: bool | None = Field(
        None,
        description="EAGLE 3.1: each next draft step takes the normed output as its feature, which keeps its scale "
        "from drifting over long drafts; read by vLLM and SGLang; default on for architecture llama, off for mla",
    )
    norm_before_residual: bool | None = Field(
        None, description="the layer's residual is the normed feature (speculators' option; vLLM only)"
    )


class LlamaDraft(Eagle3Draft):
    """EAGLE-3 with one Llama decoder layer (MHA/GQA): the default family, the drafter every engine serves, for any
    target. Unset, a fresh drafter has fc_norm and norm_output on (drafters/eagle3/llama.draft_settings: the τ
    race's pick)."""

    architecture: Literal["llama"] | None = Field(
        None,
        description="the drafter family, one of the models listed above (docs/config.md); unset: llama, the EAGLE-3 "
        "drafter every engine serves",
    )
    num_key_value_heads: int | None = Field(None, ge=1, description="GQA: key/value heads (default: the target's)")
    head_dim: int | None = Field(None, ge=1, description="per-head width (default: the target's)")
    num_layers: int | None = Field(
        None,
        ge=1,
        description="draft decoder layers (default 1, EAGLE-3's): the first reads the token embedding and the fused "
        "feature, each further one the layer below's output, with its own KV cache, as vLLM's llama_eagle3.py serves "
        "them (the peers train P-EAGLE with 4); every TTT step runs every layer",
    )
    norm_before_fc: bool | None = Field(
        None,
        description="one RMSNorm over the concatenated aux states (input_norm, gpt-oss style); exclusive with "
        "fc_norm (setting it leaves fc_norm off); vLLM and SGLang's Llama drafter read it (SGLang since sglang#32334)",
    )
    sliding_window: WindowSetting = Field(
        AUTO,
        description="the drafter attends the last N positions only (vLLM's sliding_window: the query's own position "
        "and the N-1 before it), in training, evaluate's decoding and the exported config (layer_types); SGLang "
        "needs --speculative-draft-window-size N, which export prints; docs/long-context.md" + AUTO_WINDOW,
    )


class PEagleDraft(LlamaDraft):
    """P-EAGLE (parallel EAGLE-3, drafters/peagle/): the Llama layer drafting all K tokens in one forward pass, K-1
    of them from parallel slots (a slot token and a learned mask_hidden feature); vLLM serves it as eagle3 with
    parallel_drafting. It trains with train.ttt, each step one parallel slot (train.ttt.steps: the slots trained)."""

    architecture: Literal["peagle"] = "peagle"  # type: ignore[assignment]  # a family of its own, with Llama's keys
    mask_token_id: int | None = Field(
        None, ge=0, description="the parallel slots' token (default: the tokenizer's mask, else pad, else eos)"
    )


class MlaDraft(Eagle3Draft):
    """EAGLE-3 with DeepSeek's multi-head latent attention: the drafter published for Kimi-K2.5/K2.6, for
    DeepSeek-V3/Kimi targets (pre-flight suggests it); its KV cache is one 576-float latent per token instead of K
    and V per head. vLLM and SGLang serve it as Eagle3DeepseekV2ForCausalLM. Its ranks default to the target's
    when it is DeepSeek-V3/Kimi-shaped, else to DeepSeek-V3's proportions of the target's head width d (12d, 4d,
    d, d/2, d); keep kv_lora_rank + qk_rope_head_dim = 576 to serve on vLLM's CPU build (its reference MLA decode
    kernel runs that size only). It takes the target's YaRN (DeepSeek's, with its softmax mscale) or no rope
    scaling; other scalings are refused (both engines would serve them as YaRN)."""

    architecture: Literal["mla"] = "mla"
    q_lora_rank: int | None = Field(None, ge=1, description="rank of the compressed query")
    kv_lora_rank: int | None = Field(None, ge=1, description="rank of the latent that keys and values expand from")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="per-head query/key width without RoPE")
    qk_rope_head_dim: int | None = Field(None, ge=1, description="per-head query/key width with RoPE")
    v_head_dim: int | None = Field(None, ge=1, description="per-head value width")


class DFlashDraft(DraftSection):
    """A block drafter: several Qwen3-style layers drafting a block in one pass (defaults: speculators 0.9.0's
    DFlash recipe; docs/drafters.md: "DFlash's keys"). Its target layers are target.aux_layers; it drafts over the
    full target vocabulary with the target's embedding and head. It trains its own block objective: train.ttt's
    loss, noise, step weights and anchor pull are refused for it."""

    architecture: Literal["dflash"] = "dflash"
    has_draft_vocab: ClassVar[bool] = False
    num_key_value_heads: int | None = Field(None, ge=1, description="GQA: key/value heads (default: the target's)")
    head_dim: int | None = Field(None, ge=1, description="per-head width (default: the target's)")
    block_size: int | None = Field(
        None, ge=2, description="anchor + mask slots per block (dspark: the drafts per block); default 16"
    )
    num_layers: int | None = Field(None, ge=1, description="draft decoder layers (default 5)")
    mask_token_id: int | None = Field(
        None, ge=0, description="the mask slots' token (default: the tokenizer's mask, else pad, else eos)"
    )
    max_anchors: int | None = Field(None, ge=1, description="anchored blocks per row and step (default 512)")
    position_weighting: Literal["dpace", "exp-decay"] | None = Field(
        None,
        description="per-slot loss weights, D-PACE (default) or DFlash's exp(-(k-1)/gamma) "
        "(dspark: exp(-k/gamma), its anchor slot drafts)",
    )
    dpace_alpha: float | None = Field(None, gt=0.0, le=1.0, description="D-PACE smoothing (default 0.5)")
    decay_gamma: float | None = Field(None, gt=0.0, description="exp-decay gamma (default 4.0)")
    shared_k_norm: bool | None = Field(
        None,
        description="one k_norm for all layers, as vLLM 0.32's CPU build applies (docs/drafters.md: 'DFlash and DSpark on the vLLM CPU build')",
    )
    sliding_window: WindowSetting = Field(
        AUTO,
        description="the drafter attends the last N positions only (vLLM's sliding_window: the query's own position "
        "and the N-1 before it; the block becomes causal, as vLLM and SGLang serve a sliding DFlash layer), in "
        "training, evaluate's decoding and the exported config (layer_types); docs/long-context.md" + AUTO_WINDOW,
    )

    objective_without_ttt = "its block objective (cross-entropy on the target's argmax, train.draft.position_weighting)"


class DSparkDraft(DFlashDraft):
    """DFlash's backbone drafting from the anchor, plus a Markov head over the block: DFlash's keys and its rank."""

    architecture: Literal["dspark"] = "dspark"  # type: ignore[assignment]  # a family of its own, with DFlash's keys
    markov_rank: int | None = Field(
        None, ge=1, description="rank of the Markov head's transition bias over the vocabulary (default 256)"
    )


class DFlash2Draft(DFlashDraft):
    """DFlash with a grouped dynamic convolution around every sublayer and a path selector over each slot's top K
    (drafters/dflash2/): DFlash's keys, the convolution's and the selector's (defaults: speculators' DFlash2)."""

    architecture: Literal["dflash2"] = "dflash2"  # type: ignore[assignment]  # a family of its own, with DFlash's keys
    conv_kernel_size: int | None = Field(None, ge=1, description="taps of each convolution along the block (default 2)")
    conv_group_size: int | None = Field(
        None, ge=1, description="channels sharing one dynamic coefficient; divides the hidden size (default 16)"
    )
    selector_rank: int | None = Field(None, ge=1, description="rank of the path selector's codebooks (default 256)")
    selector_top_k: int | None = Field(None, ge=1, description="candidates per slot the selector re-ranks (default 16)")
    selector_loss_weight: float | None = Field(
        None, ge=0.0, description="weight of the selector's cross-entropy beside the block loss (default 1)"
    )


def _family_of(value: Any) -> Any:
    architecture = value.get("architecture") if isinstance(value, dict) else getattr(value, "architecture", None)
    return architecture or DEFAULT_ARCHITECTURE


# train.draft's model of each drafter family, by the family's name in drafters/registry.FAMILIES (config is below the
# families' layer and cannot ask the registry; tests/drafters/test_drafter_registry.py holds the two tables to the same names).
# A new family: its model above, and its line here.
DRAFT_MODELS: dict[str, type[DraftSection]] = {
    "peagle": PEagleDraft,
    "llama": LlamaDraft,
    "mla": MlaDraft,
    "dflash": DFlashDraft,
    "dspark": DSparkDraft,
    "dflash2": DFlash2Draft,
}
# The train.draft keys each family reads (the others do nothing for it, so setting one is an error)
DRAFT_KEYS: dict[str, frozenset[str]] = {name: frozenset(model.model_fields) for name, model in DRAFT_MODELS.items()}


def _of_its_family(value: Any) -> DraftSection:
    """train.draft validated by the model of the family its architecture names (unset: llama). DRAFT_MODELS is read
    as each config loads: a family added to it (a test adds one in memory) is one the config accepts."""
    family = _family_of(value)
    if not isinstance(family, str) or family not in DRAFT_MODELS:
        raise ValueError(
            f"train.draft.architecture '{family}' is not a drafter family: one of {', '.join(DRAFT_MODELS)}"
        )
    return DRAFT_MODELS[family].model_validate(value)


# train.draft's type: one of DRAFT_MODELS, picked by train.draft.architecture, and dumped with its own model's keys
DraftConfig = Annotated[SerializeAsAny[DraftSection], PlainValidator(_of_its_family)]


def every_draft_key() -> dict[str, None]:
    """Every family's train.draft keys, in the order of their models' fields (the order a dump lists them in)."""
    return dict.fromkeys(key for model in DRAFT_MODELS.values() for key in model.model_fields)


def _not_read(architecture: str, keys: list[str]) -> str:
    owners = {key: [name for name, model in DRAFT_MODELS.items() if key in model.model_fields] for key in keys}
    listed = "; ".join(f"{key} ({', '.join(owners[key])})" for key in keys)
    one = len(keys) == 1
    return (
        f"architecture {architecture} does not read {listed}: remove {'it' if one else 'them'} or set the "
        f"architecture that reads {'it' if one else 'them'}"
    )

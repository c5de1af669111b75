"""The run config: one YAML file, validated by pydantic, one section per stage.

Unknown keys are an error that names the key (a typo such as ``max_token`` must never be silently
ignored for a twelve-hour run). Keys that name a file or folder carry a ``ConfigPath`` marker in their type;
``parse_config`` finds them in the schema and resolves relative ones against the folder of the config file.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from eaglekit.divergences import KLDiv, LKHybrid, LossChoice, loss_reference
from eaglekit.errors import UsageError

# What users type for a dtype, and the name eaglekit (and torch) uses for it.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "e4m3": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}


def _dtype_alias(value: Any) -> Any:
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        return DTYPE_ALIASES.get(name, name)
    return value


# A dtype key accepts the aliases users type (bf16, fp16, fp32, ...) and stores eaglekit's name for it.
DtypeAlias = BeforeValidator(_dtype_alias)


@dataclass(frozen=True)
class ConfigPath:
    """Marks a key that names a file or folder: parse_config resolves a relative value against the config's folder."""

    hub_ok: bool = False  # an ``org/name`` hub id that is not a local folder stays as it is
    inline_prefix: str | None = None  # a value starting with this is the content itself (an inline chat template)


# Markers for Annotated[...] on the whole field type (``Annotated[str | None, PATH]``), where pydantic keeps them.
PATH = ConfigPath()
PATH_OR_HUB_ID = ConfigPath(hub_ok=True)
TEMPLATE_OR_PATH = ConfigPath(inline_prefix="{")


# torch.manual_seed, random.seed and numpy's legacy np.random.seed (train seeds all three) all take this range.
SEED_LIMIT = 2**32
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT, description="0 <= seed < 2**32 (numpy's seed range)")]
INT64_LIMIT = 2**63  # torch tensors, numpy and the JSON servers take hold integers in 64 bits
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0.0)]


class Section(BaseModel):
    # inf and nan mean nothing for any float key (a rate, a share, a timeout); `gt=0` alone lets inf through
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_64_bits(cls, value: Any) -> Any:
        # a count past 2**63 passes every `ge` but overflows the first tensor or seed it reaches
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and not -INT64_LIMIT <= item < INT64_LIMIT:
                raise ValueError("must fit in 64 bits (below 2**63)")
        return value


class ServerPoolConfig(Section):
    """A pool of OpenAI-compatible servers, as ``serving.client`` drives it: generate's openai backend and
    extract's vLLM backend. Each section keeps its own defaults where the two workloads differ."""

    servers: list[str] = Field(default_factory=list, description="base URLs ending in /v1")
    model: str | None = Field(None, description="served model id")
    api_key_env: str | None = Field(None, description="name of the env variable holding the API key")
    concurrency: int = Field(16, ge=1, description="in-flight requests per server")
    timeout: float = Field(600.0, gt=0, description="seconds per request")
    max_retries: int = Field(5, ge=0)
    retry_backoff: float = Field(
        1.0, ge=0.0, description="seconds before the first retry; doubles per attempt, jittered"
    )
    probe_interval: float = Field(
        30.0, gt=0, description="seconds before a server taken out of rotation is tried again"
    )
    outage_timeout: float = Field(
        600.0, gt=0, description="seconds the run waits while every server is out of rotation"
    )


class TargetConfig(Section):
    model: Annotated[str, PATH_OR_HUB_ID] = Field(
        min_length=1, description="Hugging Face folder or hub id of the target model"
    )
    chat_template: Annotated[str | None, TEMPLATE_OR_PATH] = Field(
        None, description="Jinja template or path to one, overriding the tokenizer's"
    )
    trust_remote_code: bool = False
    aux_layers: list[NonNegativeInt] | None = Field(
        None, description="HF hidden_states indices; default [2, N//2, N-3]"
    )
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], DtypeAlias] = "auto"
    device_map: str | None = Field(None, description="e.g. 'auto' to shard a large target over the GPUs")


class DataConfig(Section):
    prompts: Annotated[str, PATH] = Field(
        min_length=1, description="JSONL (ShareGPT/OpenAI messages), Parquet, or a datasets saved folder"
    )
    max_samples: int | None = Field(None, ge=1)
    on_bad_row: Literal["fail", "skip"] = "fail"
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of samples held out for evaluation")


class GenerateConfig(ServerPoolConfig):
    """Sampling the target's replies; the server-pool keys (ServerPoolConfig) are for the openai backend."""

    backend: Literal["local", "openai"] = "local"
    max_tokens: int = Field(512, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    reasoning: Literal["required", "optional", "off"] | None = Field(
        None,
        description="default: required when the target's chat template has think tags, else optional; "
        "YAML's on/yes/true mean required, off/no/false mean off",
    )
    gate_samples: int = Field(20, ge=1, description="completions checked by the reasoning gate")
    gate_max_empty_share: float = Field(0.1, ge=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, description="local backend: prompts per generate() call")
    seed: Seed = 0
    extra_body: dict[str, Any] = Field(default_factory=dict)
    return_token_ids: bool = True

    @field_validator("reasoning", mode="before")
    @classmethod
    def _yaml_boolean(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` / `on` as a boolean: take it as the choice it spells
        if isinstance(value, bool):
            return "required" if value else "off"
        return value


class PrepareConfig(Section):
    max_length: int = Field(2048, ge=8)
    overlong: Literal["drop", "truncate"] = "drop"
    keep_length_stopped: bool = Field(
        False,
        description="keep responses cut by max_tokens (finish_reason=length); their end-of-turn was never generated",
    )


class VocabConfig(Section):
    draft_vocab_size: int = Field(32000, ge=1)


class VllmFeaturesConfig(ServerPoolConfig):
    """extract.backend vllm: running vLLM servers started with the extract_hidden_states method
    (`eaglekit serve-command CONFIG` prints the command)."""

    model: str | None = Field(None, description="served model id (default: the target path, vLLM's default id)")
    storage_path: Annotated[str | None, PATH] = Field(
        None,
        min_length=1,
        description="the servers' shared_storage_path, as this machine sees it (a shared folder: the servers write "
        "each request's hidden states there); required by the file transport (extract.mode offline, and stream with "
        "extract.stream.transport file), unused with transport mooncake",
    )
    connector: Literal["stock", "cpu"] = Field(
        "stock",
        description="stock: vLLM's ExampleHiddenStatesConnector (GPUs); cpu: eaglekit's CPU-capable "
        "subclass (vLLM's CPU build), loaded from eaglekit's vllm_plugin folder",
    )
    # each request carries a whole sample's hidden states to disk: fewer in flight than generate's replies
    concurrency: int = Field(8, ge=1, description="in-flight requests per server")
    timeout: float = Field(600.0, gt=0, description="seconds per request, and per wait for its file")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's --gpu-memory-utilization for the servers (`serve-command` prints it): the share of each "
        "of its GPUs' memory a server takes (weights, KV cache, activations); unset: vLLM's default (0.92 in vLLM 0.32)",
    )
    shares_trainer_gpus: bool = Field(
        False,
        description="extract.mode stream: the servers run on the GPUs train uses (one node): plan and train's "
        "pre-flight add their gpu_memory_utilization × the GPU's memory to the drafter's step memory per GPU",
    )


class MooncakeStoreConfig(Section):
    """extract.stream.transport mooncake: the Mooncake store speculators' MooncakeHiddenStatesConnector (hs-connectors)
    puts each request's hidden states into. The keys are that connector's ``kv_connector_extra_config.mooncake``
    keys, with its defaults; `eaglekit serve-command CONFIG` prints them for the servers."""

    master_server_address: str = Field("127.0.0.1:50051", min_length=1, description="the mooncake_master, host:port")
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        min_length=1,
        description="P2PHANDSHAKE (no metadata server), or http://host:port/metadata (mooncake_master "
        "--enable_http_metadata_server), or an etcd address",
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field("", description="RDMA device(s), e.g. mlx5_0 or mlx5_0,mlx5_1; empty: Mooncake chooses")
    local_hostname: str | None = Field(
        None,
        description="this machine's address as the servers reach it (default: $MOONCAKE_LOCAL_HOSTNAME, else the "
        "host name's address, as hs-connectors does); each server sets its own in $MOONCAKE_LOCAL_HOSTNAME",
    )
    global_segment_size: int = Field(
        4 << 30,
        ge=1 << 20,
        description="bytes of memory each server lends the store (where the hidden states wait until read); "
        "extract.stream.spool_gb must fit in 90% of the servers' segments together (the master evicts above that)",
    )
    local_buffer_size: int = Field(2 << 30, ge=1 << 20, description="each server's Mooncake staging buffer, bytes")


class FeatureStreamConfig(Section):
    """extract.mode stream: train asks the vLLM feature servers (extract.vllm) for each upcoming micro-batch's
    hidden states instead of reading shards; nothing but the servers' in-flight request files is stored."""

    transport: Literal["file", "mooncake"] = Field(
        "file",
        description="how the hidden states travel from the servers: file: vLLM's hidden-states connector writes a "
        "file per request to extract.vllm.storage_path; mooncake: speculators' MooncakeHiddenStatesConnector puts "
        "them into a Mooncake store (extract.stream.mooncake), over TCP or RDMA, no shared folder",
    )
    mooncake: MooncakeStoreConfig = Field(default_factory=MooncakeStoreConfig)

    spool_gb: float = Field(
        4.0,
        gt=0,
        description="GB the servers' hidden-states files may take in extract.vllm.storage_path at once (with "
        "transport mooncake: the entries in the Mooncake store): requests wait while those in flight would pass it",
    )
    ahead: int = Field(4, ge=1, description="micro-batches assembled ahead of the optimizer (held in memory)")
    cache_gb: float = Field(
        0.0,
        ge=0,
        description="epochs past the first: 0 requests every sample's features again; > 0 keeps up to this many GB "
        "of encoded features in memory and reuses them (the rest is requested again); the held-out rows are kept "
        "between evaluations up to max(cache_gb, 1 GB), else requested again at each evaluation",
    )

    @model_validator(mode="after")
    def _mooncake_only_with_its_transport(self) -> FeatureStreamConfig:
        # a dump (RUN_DIR/config.yaml) holds the default section: only settings that would do something are refused
        if self.transport != "mooncake" and self.mooncake != MooncakeStoreConfig():
            raise ValueError("mooncake is set but transport is 'file': set transport: mooncake, or remove mooncake")
        return self


class ExtractConfig(Section):
    mode: Literal["online", "offline", "stream"] = Field(
        "online",
        description="online: the target runs inside train; offline: extract stores every sample's features on disk "
        "first; stream: train requests them from the vLLM servers (extract.backend vllm) as it goes, storing only a "
        "bounded spool (extract.stream)",
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="hf: the target in this process (transformers); vllm: hidden states from vLLM servers"
    )
    dtype: Annotated[Literal["bfloat16", "fp8", "float16", "float32"], DtypeAlias] = Field(
        "bfloat16",
        description="feature storage: fp8 is e4m3 with a power-of-two scale per token and state (half of bf16)",
    )
    shard_tokens: int = Field(1_000_000, ge=1, description="tokens per feature shard")
    batch_tokens: int = Field(8192, ge=1)
    writer_queue: int = Field(4, ge=1, description="batches waiting for the background shard writer at most")
    vllm: VllmFeaturesConfig | None = None
    stream: FeatureStreamConfig = Field(default_factory=FeatureStreamConfig)

    @property
    def offline(self) -> bool:
        """Features are extracted to disk first (the extract stage runs); online, train runs the target itself."""
        return self.mode == "offline"

    @property
    def online(self) -> bool:
        """The target runs inside train (neither shards nor servers)."""
        return self.mode == "online"

    @property
    def streamed(self) -> bool:
        """train requests the features from the vLLM servers as it goes (no extract stage, no shards)."""
        return self.mode == "stream"

    @property
    def through_mooncake(self) -> bool:
        """A stream whose hidden states go through the Mooncake store; every other way the vLLM servers hand them
        over (offline extraction, a stream with transport file) is a file in extract.vllm.storage_path."""
        return self.streamed and self.stream.transport == "mooncake"


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
    target. Unset, a fresh drafter has fc_norm and norm_output on (drafters/eagle3_llama.draft_settings: the τ
    race's pick)."""

    architecture: Literal["llama"] | None = Field(
        None,
        description="llama (MHA/GQA, the default) or mla (DeepSeek-V3/Kimi latent attention): an EAGLE-3 drafter; "
        "dflash: a block drafter (several Qwen3-style layers drafting a block in one pass, model/dflash.py); "
        "dspark: DFlash's backbone drafting from the anchor, plus a Markov head over the block (model/dspark.py)",
    )
    num_key_value_heads: int | None = Field(None, ge=1, description="GQA: key/value heads (default: the target's)")
    head_dim: int | None = Field(None, ge=1, description="per-head width (default: the target's)")
    norm_before_fc: bool | None = Field(
        None,
        description="one RMSNorm over the concatenated aux states (input_norm, gpt-oss style); exclusive with "
        "fc_norm (setting it leaves fc_norm off); vLLM only: export writes no SGLang command",
    )
    sliding_window: WindowSetting = Field(
        AUTO,
        description="the drafter attends the last N positions only (vLLM's sliding_window: the query's own position "
        "and the N-1 before it), in training, evaluate's decoding and the exported config (layer_types); SGLang "
        "needs --speculative-draft-window-size N, which export prints; docs/long-context.md" + AUTO_WINDOW,
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


def _family_of(value: Any) -> Any:
    architecture = value.get("architecture") if isinstance(value, dict) else getattr(value, "architecture", None)
    return architecture or DEFAULT_ARCHITECTURE


# train.draft: one model per drafter family, picked by train.draft.architecture (unset: llama). Each tag is the
# family's name in drafters/registry.FAMILIES (config is below the families' layer and cannot ask the registry;
# tests/test_drafter_registry.py holds the two tables to the same names).
DraftConfig = Annotated[
    Annotated[LlamaDraft, Tag("llama")]
    | Annotated[MlaDraft, Tag("mla")]
    | Annotated[DFlashDraft, Tag("dflash")]
    | Annotated[DSparkDraft, Tag("dspark")],
    Discriminator(_family_of),
]
DRAFT_MODELS: dict[str, type[DraftSection]] = {
    next(m.tag for m in member.__metadata__ if isinstance(m, Tag)): get_args(member)[0]
    for member in get_args(get_args(DraftConfig)[0])
}
# The train.draft keys each family reads (the others do nothing for it, so setting one is an error)
DRAFT_KEYS: dict[str, frozenset[str]] = {name: frozenset(model.model_fields) for name, model in DRAFT_MODELS.items()}


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


# train.ttt keys only EAGLE-3's TTT objective reads (training/objective.py, training/ttt.py): set away from their
# defaults for a block drafter, they are refused (steps, decay and the step's kernels are left out: a config switched
# from EAGLE-3, as the demo's, has them, and they change nothing a block drafter learns)
TTT_ONLY_KEYS = ("step_weights", "loss", "loss_normalization", "noise", "noise_scale", "anchor_weight",
                 "activation_checkpointing")  # fmt: skip


class ConfigDeprecation(FutureWarning):
    """A key loaded under an old spelling (a FutureWarning: Python shows it to users by default); ``section`` and
    ``key`` are where it stands in the config (the warning is shown at that line of the file)."""

    def __init__(self, message: str, section: str = "", key: str = "") -> None:
        super().__init__(message)
        self.section, self.key = section, key


def line_of_key(text: str, section: str, key: str) -> int:
    """The 1-based line of ``key`` inside the top-level ``section`` of a YAML config's ``text``; 0 when not found
    (a flow mapping, an anchor: the message still names the key)."""
    lines = text.splitlines()
    top = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(section)}\s*:", line)), None)
    if top is None:
        return 0
    for i in range(top + 1, len(lines)):
        line = lines[i]
        if line and not line[0].isspace() and not line.startswith("#"):
            return 0  # the next section
        if re.match(rf"\s+{re.escape(key)}\s*:", line):
            return i + 1
    return 0


def move_old_spellings(data: Any, moved: dict[str, str], section: str) -> Any:
    """A section's raw keys with the old spellings in ``moved`` (old key: its new dotted path, both inside
    ``section``) moved to their new place, each with a ConfigDeprecation naming both; old and new spelling of one
    key together are refused. Where the new path runs through a bare name (``loss: lk_hybrid``, then ``lk_eta``
    joins it), the name becomes ``{name: ...}``, what the shorthand means."""
    if not isinstance(data, dict) or not any(old in data for old in moved):
        return data
    data = dict(data)
    for old, new in moved.items():
        if old not in data:
            continue
        value = data.pop(old)
        *parents, leaf = new.split(".")
        node = data
        for part in parents:
            child = node.get(part)
            if child is None or isinstance(child, str):
                child = {} if child is None else {"name": child}
            if not isinstance(child, dict):
                raise ValueError(f"{section}.{old} moves into {section}.{'.'.join(parents)}, which is not a mapping")
            node[part] = node = dict(child)
        if leaf in node:
            raise ValueError(f"{section}.{old} and {section}.{new} are both set: keep {section}.{new} only")
        node[leaf] = value
        warnings.warn(
            ConfigDeprecation(
                f"{section}.{old} is an old spelling: write {section}.{new} (the old one still loads, for now)",
                section,
                old,
            ),
            stacklevel=2,
        )
    return data


class StepWeights(tuple[float, ...]):
    """The loss weight of each TTT step, one per step: their number is the step count."""

    @classmethod
    def decayed(cls, steps: int, decay: float) -> StepWeights:
        """decay^k for k = 0..steps-1 (EAGLE's and SpecForge's weighting): the one place it is computed."""
        return cls(decay**k for k in range(steps))


class TTTConfig(Section):
    """EAGLE-3's training-time test (training/ttt.py): its steps and their weights, the loss and its levers, the
    step's kernels. A block drafter (dflash, dspark) trains its own objective, which reads none of them."""

    steps: int = Field(7, ge=1, description="draft steps trained per position, each on the drafter's own last output")
    decay: float = Field(0.8, gt=0.0, description="step k's loss weight decay^k, unless step_weights is given")
    step_weights: list[NonNegativeFloat] | None = Field(
        None,
        description="loss weight of each TTT step, one per step (speculators: [1, 1, 1] at 3 steps); "
        "None: decay**k (EAGLE / SpecForge: 0.8**k at 7 steps)",
    )
    loss: LossChoice = Field(
        default_factory=KLDiv,
        description="divergence between the target's and the draft's distributions (eaglekit/divergences.py): a "
        "name, or {name: NAME, PARAMETER: VALUE} for one with parameters. " + loss_reference(),
    )
    loss_normalization: Literal["token", "sequence"] = Field(
        "token",
        description="token: each TTT step's loss is the mean over its counted positions (long sequences weigh "
        "more); sequence: the mean over documents of each document's mean (DeepSpec's remedy). Under DDP both "
        "count every rank's positions / documents",
    )
    noise: Literal["none", "uniform", "gaussian"] = Field(
        "none",
        description="noise added to the target's hidden states (the drafter's input features) in training only, "
        "so the drafter sees features as imperfect as its own later steps; uniform: U(-noise_scale, "
        "noise_scale), gaussian: N(0, noise_scale^2)",
    )
    noise_scale: float = Field(0.05, ge=0.0, description="the noise's half-width (uniform) or standard deviation")
    anchor_weight: float = Field(
        0.0,
        ge=0.0,
        description="L2-SP pull toward the starting weights (train.init_from): "
        "adds anchor_weight/2 * ||θ - θ0||² to the loss",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each TTT step's decoder layer in backward instead of keeping its activations: for "
        "rows of tens of thousands of tokens (docs/long-context.md; `eaglekit plan` gives the memory either way), "
        "about 40 % more step time",
    )
    attention: Literal["auto", "reference", "sdpa", "flex"] = Field(
        "auto",
        description="the TTT step's attention kernels: flex (fused flex attention for the draft steps and packed "
        "rows, FlashAttention for step 0; CUDA only), sdpa (FlashAttention for unpacked step 0 only), reference "
        "(the exact blockwise attention every other path is tested against); auto: flex on CUDA, else reference",
    )
    head_loss: Literal["auto", "reference", "compiled"] = Field(
        "auto",
        description="the draft head + loss per chunk of rows: compiled (torch.compile fuses its elementwise work) "
        "or reference; auto: compiled on CUDA, else reference",
    )
    compile: bool = Field(
        False, description="torch.compile the drafter's layer for the TTT step (fuses norms, RoPE, SwiGLU)"
    )

    @model_validator(mode="after")
    def _one_weight_per_step(self) -> TTTConfig:
        if self.step_weights is not None and len(self.step_weights) != self.steps:
            raise ValueError(
                f"step_weights has {len(self.step_weights)} weights for steps {self.steps}: give one per step"
            )
        return self

    @property
    def weights(self) -> StepWeights:
        """Each step's loss weight: step_weights when given, else decay^k."""
        if self.step_weights is not None:
            return StepWeights(self.step_weights)
        return StepWeights.decayed(self.steps, self.decay)


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
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(0.5, gt=0.0)
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    epochs: float = Field(1.0, gt=0.0)
    eval_every: int = Field(100, ge=1)
    eval_samples: int | None = Field(512, ge=1, description="held-out samples per evaluation (None: all of them)")
    log_every: int = Field(10, ge=1, description="optimizer steps per line in train/metrics.jsonl")
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

    @field_validator("draft", mode="before")
    @classmethod
    def _a_drafter_family(cls, value: Any) -> Any:
        architecture = value.get("architecture") if isinstance(value, dict) else None
        if architecture is not None and architecture not in DRAFT_MODELS:
            raise ValueError(
                f"train.draft.architecture '{architecture}' is not a drafter family: one of {', '.join(DRAFT_MODELS)}"
            )
        return value

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
        training/block.py's): one set away from its default is refused rather than ignored."""
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


class SuiteConfig(Section):
    """A named benchmark suite (eaglekit.data.suites) measured beside the run's own prompts."""

    # checked by eaglekit.data.suites when loaded (config, the lowest layer, does not import it)
    name: str = Field(description="mt_bench, gsm8k, humaneval, math500, alpaca or longbench_v2")
    num_samples: int | None = Field(None, ge=1, description="prompts taken from the start; default: the stage's")
    path: Annotated[str | None, PATH] = Field(
        None, description="local copy in the hub's layout (JSONL/Parquet/saved folder)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=64, description="cut the middle of a longer user turn to fit (LongBench's truncation)"
    )


def _suite_list(value: Any) -> Any:
    # `suites: [gsm8k, mt_bench]` is the common case: a bare name is a suite with the defaults
    return [{"name": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value


class EvaluateConfig(Section):
    prompts: Annotated[str | None, PATH] = Field(None, description="default: the held-out split of this run's data")
    num_samples: int = Field(8, ge=1, description="prompts decoded per method, K and temperature")
    num_speculative_tokens: list[PositiveInt] = Field(default_factory=lambda: [1, 3, 5, 7], min_length=1)
    temperatures: list[NonNegativeFloat] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    max_new_tokens: int = Field(128, ge=1)
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    seed: Seed = 0
    checkpoint: Annotated[str | None, PATH] = Field(None, description="drafter to evaluate; default: this run's best")
    suites: list[SuiteConfig] = Field(
        default_factory=list, description="benchmark suites measured too, e.g. [mt_bench, gsm8k]; one table each"
    )
    reasoning: Literal["on", "off", "both"] | None = Field(
        None,
        description="the chat template's thinking switch (enable_thinking) as served; both measures each; "
        "default: the template's own default",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="more chat template arguments, as vLLM's chat_template_kwargs"
    )
    context_lengths: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        description="the context lengths (tokens) the drafter will be served at; pre-flight warns when they lie far "
        "beyond the training documents (default: the target's max_position_embeddings, vLLM's default max_model_len)",
    )

    @field_validator("suites", mode="before")
    @classmethod
    def _bare_suite_names(cls, value: Any) -> Any:
        return _suite_list(value)

    @field_validator("reasoning", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML reads an unquoted on/off as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


ExportForm = Literal["eagle3", "speculators"]


def _both_forms() -> list[ExportForm]:
    return ["eagle3", "speculators"]


class ExportConfig(Section):
    formats: list[ExportForm] = Field(default_factory=_both_forms)
    verifier: str | None = Field(None, description="hub id of the target, required by vLLM's speculators form")
    num_speculative_tokens: int = Field(3, ge=1)
    include_embeddings: bool = True


class VerifyConfig(Section):
    """The exported drafter measured in the serving engine (run only when ``engine`` or ``server`` is set)."""

    engine: Literal["vllm"] | None = Field(
        None, description="start this engine with the target and each exported form, on a free loopback port"
    )
    server: str | None = Field(
        None, description="or: base URL of a vLLM or SGLang server you started with the command export printed"
    )
    python: Annotated[str | None, PATH] = Field(
        None, description="python of the environment with vLLM (default: $EAGLEKIT_VLLM_PYTHON, then .venv-vllm)"
    )
    engine_args: list[str] = Field(
        default_factory=list,
        description="extra flags for the engine eaglekit starts, e.g. [--tensor-parallel-size, '8']",
    )
    formats: list[Literal["eagle3", "speculators"]] | None = Field(
        None, description="exported forms to serve (engine: vllm); default: those export wrote"
    )
    num_speculative_tokens: list[PositiveInt] | None = Field(
        None, min_length=1, description="K values to serve (engine: vllm); default: [export.num_speculative_tokens]"
    )
    num_samples: int | None = Field(None, ge=1, description="prompts sent; default evaluate.num_samples")
    max_new_tokens: int | None = Field(None, ge=1, description="default evaluate.max_new_tokens")
    tau_tolerance: float = Field(
        0.01,
        ge=0.0,
        description="largest |served τ - offline τ| / offline τ that passes (docs/verify.md: 'Tolerances': 0 "
        "measured in float32 and bfloat16; aux ids shifted by one: 2.7% at K=3)",
    )
    position_tolerance: float = Field(
        0.02,
        ge=0.0,
        description="largest |served - offline| acceptance rate at any draft position that passes "
        "(aux ids shifted by one: 0.045 at K=3)",
    )
    greedy_tolerance: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of prompts whose served greedy output may differ from plain decoding "
        "(0 in float32; bfloat16 kernels may flip near-ties on long outputs)",
    )
    suites: list[SuiteConfig] | None = Field(None, description="benchmark suites served; default evaluate.suites")
    startup_timeout: float = Field(900.0, gt=0, description="seconds to wait for an engine eaglekit starts")
    timeout: float = Field(600.0, gt=0, description="seconds per request")

    @field_validator("suites", mode="before")
    @classmethod
    def _bare_suite_names(cls, value: Any) -> Any:
        return _suite_list(value)


class PreflightConfig(Section):
    disk_probe_mb: float = Field(
        64,
        ge=0,
        description="MB written (incompressible, fsync'd) to measure the run directory's write rate; 0 skips the probe",
    )
    disk_probe_seconds: float = Field(2.0, gt=0, description="the write probe stops after this many seconds of writing")


class RunConfig(Section):
    run_dir: Annotated[str, PATH] = Field(min_length=1)
    target: TargetConfig
    data: DataConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)

    # Where the config was read from; not a key of the file.
    source: Path | None = Field(None, exclude=True)

    @field_validator("run_dir")
    @classmethod
    def _names_a_folder(cls, value: str) -> str:
        if not value.strip():  # a blank path would be the current directory
            raise ValueError("must name a directory (it is blank)")
        return value

    @model_validator(mode="after")
    def _context_parallel_reads_offline_features(self) -> RunConfig:
        if self.train.context_parallel > 1 and not self.extract.offline:
            raise ValueError(
                f"train.context_parallel is {self.train.context_parallel} with {self.extract.mode} features: every "
                "rank would run (online) or request (stream) the target's features of the whole row, which is what "
                "does not fit; set extract.mode: offline (each rank then reads only its share of the row's stored "
                "features)"
            )
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude={"source"}), sort_keys=False)


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "/", "~"))


def _resolve(base: Path, value: str, marker: ConfigPath) -> str:
    """A path resolved against the config's folder; a hub id that is not a local folder, or inline content, as is."""
    if marker.inline_prefix and value.lstrip().startswith(marker.inline_prefix):
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = (base / p).resolve()
    if marker.hub_ok and _looks_like_hub_id(value) and not candidate.exists():
        return value
    return str(candidate)


def _path_marker(field: FieldInfo) -> ConfigPath | None:
    return next((m for m in field.metadata if isinstance(m, ConfigPath)), None)


def _resolve_paths(section: BaseModel, base: Path) -> None:
    """Resolve every key marked as a path (ConfigPath), in this section and the sections below it."""
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            _resolve_paths(value, base)
        elif isinstance(value, list):  # e.g. evaluate.suites
            for item in value:
                if isinstance(item, BaseModel):
                    _resolve_paths(item, base)
        elif isinstance(value, str) and value and (marker := _path_marker(field)):
            setattr(section, name, _resolve(base, value, marker))


def _key_of(loc: tuple[int | str, ...]) -> str:
    """An error's dotted key; within train.draft, without the family pydantic names as the union's member
    (``train.draft.dflash.block_size`` is the key ``train.draft.block_size``)."""
    parts = [str(p) for p in loc]
    if parts[:2] == ["train", "draft"] and len(parts) > 2 and parts[2] in DRAFT_MODELS:
        del parts[2]
    return ".".join(parts)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for e in err.errors():
        key = _key_of(e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{key}' (check the spelling; see docs/config.md)")
        elif e["type"] == "missing":
            lines.append(f"  - missing required key '{key}'")
        elif not key:  # a check across sections (RunConfig's own validators): its message names the keys
            lines.append(f"  - {e['msg'].removeprefix('Value error, ')}")
        elif isinstance(e.get("input"), bool):
            lines.append(
                f"  - '{key}': {e['msg']} (got {e['input']!r}: YAML reads unquoted yes/no/on/off/true/false "
                f'as a boolean; quote the value, e.g. "off")'
            )
        else:
            lines.append(f"  - '{key}': {e['msg'].removeprefix('Value error, ')} (got {_shown(e.get('input'))})")
    return "\n".join(lines)


def _shown(value: Any, limit: int = 80) -> str:
    """A value as the error line quotes it: cut short, since a config key can hold a megabyte string."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None, text: str | None = None
) -> RunConfig:
    """The run config of ``data`` (a YAML mapping) read from ``source`` (its ``text``: warnings name its lines)."""
    if not isinstance(data, dict):
        raise UsageError(
            f"{source}: the config must be a YAML mapping of sections, got {type(data).__name__}",
            "start from the config that `eaglekit demo` writes into its run directory",
        )
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise UsageError(_format_validation_error(err, source), "fix the named keys") from None
    finally:
        for w in said:  # an old spelling is the config file's, not a line of config.py: shown at its line there
            said_of = w.message
            if isinstance(said_of, ConfigDeprecation):
                line = line_of_key(text, said_of.section, said_of.key) if text else 0
                warnings.warn_explicit(said_of, ConfigDeprecation, source, line)
            else:
                warnings.warn_explicit(said_of, w.category, w.filename, w.lineno)
    _resolve_paths(cfg, base_dir or Path.cwd())
    blocking = next((p for p in (cfg.run_path, *cfg.run_path.parents) if p.exists() or p.is_symlink()), None)
    if blocking is not None and not blocking.is_dir():
        raise UsageError(
            f"{source}: run_dir {cfg.run_dir} cannot be a directory: {blocking} is "
            + ("a broken symlink" if blocking.is_symlink() and not blocking.exists() else "a file"),
            "set run_dir to a new or existing directory",
        )
    if cfg.extract.streamed and cfg.extract.backend != "vllm":
        raise UsageError(
            f"{source}: extract.mode is 'stream' but extract.backend is '{cfg.extract.backend}'",
            "set extract.backend: vllm and extract.vllm (the features stream from vLLM servers), or extract.mode: "
            "online to run the target inside train",
        )
    if cfg.extract.backend == "vllm":
        if cfg.extract.online:
            raise UsageError(
                f"{source}: extract.backend is 'vllm' but extract.mode is 'online'",
                "set extract.mode: offline (vLLM's features stored on disk first) or stream (requested as training "
                "goes); online training runs the target here",
            )
        if cfg.extract.vllm is None or not cfg.extract.vllm.servers:
            raise UsageError(
                f"{source}: extract.backend is 'vllm' but extract.vllm.servers is empty",
                "add extract.vllm: {servers: [http://host:8000/v1], storage_path: /shared/hidden-states}",
            )
        if cfg.extract.vllm.storage_path is None and not cfg.extract.through_mooncake:
            reader = "train's stream (extract.stream.transport file)" if cfg.extract.streamed else "offline extraction"
            raise UsageError(
                f"{source}: extract.vllm.storage_path is not set: {reader} reads each request's hidden states from "
                "the file the servers write there",
                "set extract.vllm.storage_path to the servers' shared_storage_path as this machine sees it (a folder "
                "both reach)"
                + (", or extract.stream.transport: mooncake (no shared folder)" if cfg.extract.streamed else ""),
            )
        if cfg.extract.vllm.shares_trainer_gpus and not cfg.extract.streamed:
            raise UsageError(
                f"{source}: extract.vllm.shares_trainer_gpus is set but extract.mode is '{cfg.extract.mode}': the "
                "servers only share the trainer's GPUs while train streams from them",
                "remove extract.vllm.shares_trainer_gpus (offline extraction runs before train, not beside it), or "
                "set extract.mode: stream",
            )
    if cfg.verify.engine and cfg.verify.server:
        raise UsageError(
            f"{source}: verify.engine and verify.server are both set",
            "set verify.engine to let eaglekit start the engine, or verify.server for one you started",
        )
    if cfg.generate.backend == "openai":
        if not cfg.generate.servers:
            raise UsageError(
                f"{source}: generate.backend is 'openai' but generate.servers is empty",
                "list the servers' base URLs, e.g. servers: [http://host:8000/v1]",
            )
        if not cfg.generate.model:
            raise UsageError(
                f"{source}: generate.backend is 'openai' but generate.model is not set",
                "set generate.model to the id the server lists under /v1/models",
            )
    return cfg


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read and validate a run config; every problem is a UsageError naming the file and key."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"config file not found: {path}", "pass the path of a YAML run config (eaglekit demo writes one)"
        )
    if path.is_dir():
        raise UsageError(f"config path is a directory: {path}", "pass the YAML file, e.g. RUN_DIR/config.yaml")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UsageError(
            f"{where}: not valid YAML ({getattr(err, 'problem', err)})", "fix the YAML syntax at that line"
        ) from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a UTF-8 text file", "pass the YAML run config") from None
    except ValueError as err:  # YAML's int() of a number longer than Python converts (4300 digits)
        raise UsageError(f"{path}: a value YAML cannot read ({err})", "fix that value") from None
    except RecursionError:
        raise UsageError(
            f"{path}: nested deeper than the YAML reader can follow", "a run config is sections of keys: flatten it"
        ) from None
    cfg = parse_config(data, source=str(path), base_dir=path.resolve().parent, text=text)
    cfg.source = path.resolve()
    return cfg

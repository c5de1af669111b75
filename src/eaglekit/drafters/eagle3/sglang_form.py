"""EAGLE-3's plain form as SGLang 0.5.23 reads it: the parameters its drafter classes build from config.json, the
parameter each weight loads into, and the config keys whose absence would build another drafter.

Read from the sglang 0.5.23 wheel: ``srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``: ``LlamaModel`` and
``LlamaDecoderLayer.__init__``, ``load_weights``) and ``srt/models/kimi_k25_eagle3.py``
(``Eagle3DeepseekV2ForCausalLM``: ``Eagle3MLAModel``, ``Eagle3MLADecoderLayer``, ``load_weights``).

- Llama: ``fc`` is ``[hidden, n * target_hidden_size]`` (``target_hidden_size`` when the key exists, else
  ``hidden_size``; n = ``num_aux_hidden_states``, else the length of ``eagle_config.eagle_aux_hidden_state_layer_ids``,
  else 3); ``fc_norm`` (or ``use_aux_norm``) builds ``fc_norm.{i}``, ``norm_before_fc`` (top level or in
  ``eagle_config``) ``input_norm``, ``norm_output`` feeds the normed state back; layer 0's q/k/v take 2H, the layers
  above H; every layer has ``hidden_norm``. ``load_weights`` renames ``midlayer`` -> ``layers.0`` and the older
  ``aux_norm_{low,mid,high}`` -> ``fc_norm.{0,1,2}``, stacks q/k/v and gate/up, adds ``model.`` where the name is not
  a parameter, turns ``d2t`` into its hot-token map, drops ``t2d``, and skips anything else it has no parameter for.
- MLA (one layer only): ``layers.0.`` -> ``model.midlayer.``, ``q_a_proj`` and ``kv_a_proj_with_mqa`` concatenated
  into ``fused_qkv_a_proj_with_mqa``, gate/up stacked, an unknown key skipped with a log line.
- Both: ``draft_vocab_size`` sizes ``lm_head`` (absent: the target's head is loaded instead),
  ``embed_tokens.weight`` is optional (the target's otherwise).

What the form must hold beyond eaglekit's own contract (``checkpoint.expected_state``) is checked by ``problems``;
tests/drafters/test_sglang_forms.py builds both SGLang classes from the wheel on the CPU and pins this restatement.
"""

from __future__ import annotations

import re
from pathlib import Path

from eaglekit.drafters.sglang_form import fill_problems, lookup, missing_keys, read_folder, refuse

LLAMA, MLA = "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"
_COMMON = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "eagle_config.eagle_aux_hidden_state_layer_ids",
)
REQUIRED = {
    LLAMA: _COMMON + ("num_key_value_heads", "head_dim"),
    MLA: _COMMON + ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
}
# read with a default of false: required only when eaglekit trained them on (FLAGS the class reads)
FLAGS_READ = {LLAMA: ("fc_norm", "norm_output", "norm_before_fc"), MLA: ("fc_norm", "norm_output")}
_OLDER = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}


def architecture(config: dict) -> str:
    return ((config.get("architectures") or [None])[0]) or ""


def required_keys(config: dict, shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[str, ...]:
    """The keys ``config`` must hold for SGLang to build the drafter written: a flag SGLang reads is required when it
    is on, or when the weights (``shapes``) hold the norm it adds; ``target_hidden_size`` when fc's width (three
    target states) is not three draft widths."""
    arch, shapes = architecture(config), shapes or {}
    weights = {"fc_norm": ("fc_norm.", "aux_norm_"), "norm_before_fc": ("input_norm.",)}
    flags = tuple(
        f
        for f in FLAGS_READ.get(arch, ())
        if config.get(f) or any(k.startswith(weights.get(f, ("-",))) for k in shapes)
    )
    keys = REQUIRED.get(arch, _COMMON) + flags
    h = config.get("hidden_size")
    fc_in = shapes.get("fc.weight", (0, 3 * (config.get("target_hidden_size") or h or 0)))[1]
    if fc_in != 3 * (h or 0):  # fc reads a target hidden size other than the draft's: SGLang must be told it
        keys += ("target_hidden_size",)
    return keys


def sglang_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """SGLang's parameters and their (unpadded) shapes, as its ``__init__``s build them from ``config``."""
    c, arch = config, architecture(config)
    h, i, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    ht = c.get("target_hidden_size") or h
    n = c.get("num_aux_hidden_states") or len(lookup(c, "eagle_config.eagle_aux_hidden_state_layer_ids") or [0] * 3)
    norms = ("input_layernorm", "post_attention_layernorm", "hidden_norm")
    mlp = {"mlp.gate_up_proj.weight": (2 * i, h), "mlp.down_proj.weight": (h, i)}
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.fc.weight": (h, n * ht),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.get("draft_vocab_size") or c["vocab_size"], h),
    }
    if c.get("fc_norm") or c.get("use_aux_norm"):
        out |= {f"model.fc_norm.{j}.weight": (ht,) for j in range(n)}
    if arch == LLAMA:
        if c.get("norm_before_fc") or lookup(c, "eagle_config.norm_before_fc"):
            out["model.input_norm.weight"] = (n * ht,)
        kv, d = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            out |= {p + f"{norm}.weight": (h,) for norm in norms} | {p + k: v for k, v in mlp.items()}
            out[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * d, 2 * h if layer == 0 else h)
            out[p + "self_attn.o_proj.weight"] = (h, heads * d)
    else:
        q, kv, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
        nope, v, p = c["qk_nope_head_dim"], c["v_head_dim"], "model.midlayer."
        out |= {p + f"{norm}.weight": (h,) for norm in norms} | {p + k: value for k, value in mlp.items()}
        out |= {
            p + "self_attn.fused_qkv_a_proj_with_mqa.weight": (q + kv + rope, 2 * h),
            p + "self_attn.q_a_layernorm.weight": (q,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q),
            p + "self_attn.kv_a_layernorm.weight": (kv,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv),
            p + "self_attn.o_proj.weight": (h, heads * v),
        }
    return out


def landing(arch: str, params: dict[str, tuple[int, ...]]):
    """The parameter each checkpoint key loads into, as the class's ``load_weights`` maps it (None: d2t, t2d)."""

    def llama(key: str) -> str | None:
        if "d2t" in key or "t2d" in key:
            return None
        for old, new in _OLDER.items():
            key = key.replace(old, new)
        for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj")):
            key = key.replace(part, stacked)
        key = key.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj")
        return key if key in params else f"model.{key}"

    def mla(key: str) -> str | None:
        if key in ("d2t", "t2d") or key.endswith((".d2t", ".t2d")):
            return None
        key = re.sub(r"^layers\.0\.", "midlayer.", key)
        key = key if key.startswith("lm_head.") else f"model.{key}"
        key = key.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj")
        return re.sub(r"\.(q_a_proj|kv_a_proj_with_mqa)\.", ".fused_qkv_a_proj_with_mqa.", key)

    return mla if arch == MLA else llama


def problems(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What SGLang would read otherwise than eaglekit wrote, each naming its key (empty: it loads as written)."""
    arch = architecture(config)
    if not arch:
        return ["config.json lacks architectures"]
    if arch not in REQUIRED:
        return [f"architectures {config.get('architectures')} names no SGLang EAGLE-3 class ({sorted(REQUIRED)})"]
    missing = missing_keys(config, required_keys(config, shapes))
    if missing:
        return missing  # SGLang's parameters are sized from those keys
    out = []
    if (config.get("draft_vocab_size") or config["vocab_size"]) != config["vocab_size"] and "d2t" not in shapes:
        out.append("the draft vocabulary is smaller than the target's but d2t is missing (SGLang's hot-token map)")
    params = sglang_parameters(config)
    # the embedding is optional: without it SGLang takes the target's
    absent_embedding = "embed_tokens.weight" not in shapes
    return out + fill_problems(
        arch,
        params,
        shapes,
        landing(arch, params),
        lambda name: absent_embedding and name.endswith("embed_tokens.weight"),
    )


def check_folder(folder: Path) -> None:
    """Refuse a plain-form folder SGLang would load otherwise than written, naming each key."""
    refuse(folder, problems(*read_folder(folder)))

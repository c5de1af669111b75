"""EAGLE-3 with a Llama layer (MHA/GQA): the default family, and the one with the most forms (plain and
speculators) and serving engines (vLLM and SGLang)."""

from __future__ import annotations

from typing import Any

from eaglekit.config import LlamaDraft, RunConfig
from eaglekit.drafters.eagle3.family import Eagle3Family
from eaglekit.drafters.eagle3.model import DrafterConfig
from eaglekit.drafters.family import Verdict, one_object
from eaglekit.model.target import text_config


class Eagle3LlamaFamily(Eagle3Family):
    name = "llama"
    title = "Llama"
    forms = ("eagle3", "speculators")
    draft_model = LlamaDraft
    card_form = "legacy flat Llama config (`LlamaForCausalLMEagle3`), `midlayer.` keys"

    def draft_settings(self, cfg: RunConfig) -> dict[str, Any]:
        """The EAGLE 3.1 flags ``fc_norm`` and ``norm_output`` are on unless set: the τ race measured them ahead of
        the plain form on every seed (benchmarks/results/levers.md, "The lever table"), and vLLM and SGLang read both.
        fc_norm stays off when norm_before_fc is asked for (one norm before fc or the other)."""
        settings = super().draft_settings(cfg)
        if settings.get("fc_norm") is None and not settings.get("norm_before_fc"):
            settings["fc_norm"] = True
        if settings.get("norm_output") is None:
            settings["norm_output"] = True
        return settings

    def shape_line(self, dc: DrafterConfig) -> str:
        layers = f", {dc.num_layers} layers" if dc.num_layers > 1 else ""
        return f"llama: heads {dc.num_attention_heads} / kv {dc.num_key_value_heads} x {dc.head_dim}{layers}"

    def layer_line(self, dc: DrafterConfig) -> str:
        return f"Llama attention: {dc.num_attention_heads} heads, {dc.num_key_value_heads} KV heads of {dc.head_dim}"

    def target_advice(self, cfg: RunConfig, hf: Any, detail: str) -> Verdict | None:
        """On a DeepSeek-V3/Kimi target, the MLA drafter is suggested unless this family was asked for."""
        if not getattr(text_config(hf), "kv_lora_rank", None) or cfg.train.draft.architecture is not None:
            return None
        return Verdict(
            "warn",
            detail + f"; the target {cfg.target.model} uses multi-head latent attention (DeepSeek-V3/Kimi)",
            "consider train.draft.architecture: mla, the drafter shape published for Kimi-K2.5/K2.6 (its KV "
            "cache is the target's small latent); set architecture: llama to keep this one",
        )


EAGLE3_LLAMA = one_object(Eagle3LlamaFamily())

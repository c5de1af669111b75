"""EAGLE-3 with a DeepSeek-V3/Kimi layer (multi-head latent attention): the drafter shape published for
Kimi-K2.5/K2.6. It has the plain form only (no speculators form: ``model/mla.NO_MLA_SPECULATORS``)."""

from __future__ import annotations

from eaglekit.config import MlaDraft
from eaglekit.drafters.eagle3.family import Eagle3Family
from eaglekit.drafters.eagle3.mla_layer import NO_MLA_SPECULATORS
from eaglekit.drafters.eagle3.model import DrafterConfig
from eaglekit.drafters.family import one_object


class Eagle3MlaFamily(Eagle3Family):
    name = "mla"
    title = "MLA"
    forms = ("eagle3",)
    draft_model = MlaDraft
    card_form = "plain DeepSeek-V2 config (`Eagle3DeepseekV2ForCausalLM`), `layers.0.` keys"
    no_speculators = "MLA drafter: only the plain form is written (no speculators form for MLA)"
    no_speculators_reason = NO_MLA_SPECULATORS

    def shape_line(self, dc: DrafterConfig) -> str:
        return (
            f"mla: q_lora_rank {dc.q_lora_rank}, kv_lora_rank {dc.kv_lora_rank}, heads {dc.num_attention_heads} x "
            f"(nope {dc.qk_nope_head_dim} + rope {dc.qk_rope_head_dim}, v {dc.v_head_dim})"
        )

    def layer_line(self, dc: DrafterConfig) -> str:
        return (
            f"multi-head latent attention: {dc.num_attention_heads} heads, q_lora_rank {dc.q_lora_rank}, "
            f"kv_lora_rank {dc.kv_lora_rank}, qk {dc.qk_nope_head_dim}+{dc.qk_rope_head_dim}, v {dc.v_head_dim}"
        )


EAGLE3_MLA = one_object(Eagle3MlaFamily())

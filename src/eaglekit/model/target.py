"""The frozen target as a feature source: aux hidden states, the final normed hidden state, and the
target distribution over the draft vocab.

Aux taps are Hugging Face ``output_hidden_states`` indices (docs/formats.md §8): index i is the *input* of
decoder layer i (index 0 the embeddings), captured with forward pre-hooks so that only the three tapped
states are ever kept, never all N+1. The target distribution comes from the final hidden state after the
target's final norm through ``lm_head``; the full-vocab logits exist only a chunk of tokens at a time.

Offline mode stores the final normed hidden state instead of logits (Ht numbers per token instead of Vd),
and the train stage turns it into logits with ``TargetHead`` — the target's ``lm_head`` alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from eaglekit.config import TargetConfig
from eaglekit.errors import EaglekitError, UsageError

# the config.json readers live in target_config (no torch: `status` reads them); kept importable from here
from eaglekit.model.target_config import aux_layer_ids as aux_layer_ids
from eaglekit.model.target_config import default_aux_layers, target_hf_config
from eaglekit.model.target_config import rope_from_config as rope_from_config
from eaglekit.model.target_config import text_config as text_config

# Full-vocab logits of at most this many elements exist at once (64 Mi floats = 256 MiB in fp32).
LOGIT_CHUNK_ELEMENTS = 1 << 26


def torch_dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def load_target(target_cfg: TargetConfig, device: torch.device | str | None = None):
    """The target as an eval-mode, frozen AutoModelForCausalLM.

    ``target.device_map`` (e.g. "auto") shards it over the visible GPUs; otherwise it goes to ``device``.
    """
    from transformers import AutoModelForCausalLM  # lazy: heavy (transformers)

    kwargs = {"dtype": torch_dtype(target_cfg.dtype), "trust_remote_code": target_cfg.trust_remote_code}
    if target_cfg.device_map:
        kwargs["device_map"] = target_cfg.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(target_cfg.model, **kwargs)
    except (OSError, ValueError) as err:
        raise EaglekitError(
            f"cannot load the target {target_cfg.model}: {err}",
            "point target.model at a Hugging Face causal-LM folder (set target.trust_remote_code "
            "for custom architectures)",
        ) from None
    if not target_cfg.device_map and device is not None:
        model.to(device)  # type: ignore[arg-type]  # transformers' decorated .to() stub takes the model as argument
    model.eval().requires_grad_(False)
    return model


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Linear]:
    """(inner model, decoder layers, final norm, lm_head) of a Llama/Qwen-style HF causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    head = getattr(model, "lm_head", None)
    if (
        not isinstance(inner, nn.Module)
        or not isinstance(layers, nn.ModuleList)
        or not isinstance(norm, nn.Module)
        or not isinstance(head, nn.Linear)
    ):
        raise EaglekitError(
            f"cannot find the decoder layers of {type(model).__name__}: eaglekit expects "
            "model.model.layers, model.model.norm and model.lm_head (Llama/Qwen/Mistral layout)",
            "use a target with that layout, or add its layout to eaglekit.model.target.decoder_parts",
        )
    return inner, layers, norm, head


def input_embedding(inner: nn.Module) -> nn.Embedding:
    """The token embedding (``embed_tokens``) of a decoder's inner model (``decoder_parts``)."""
    embed = getattr(inner, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        raise EaglekitError(
            f"cannot find the token embedding of {type(inner).__name__}: eaglekit expects model.model.embed_tokens",
            "use a target with the Llama/Qwen/Mistral layout",
        )
    return embed


def draft_logits(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk_elements: int = LOGIT_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits over the draft vocab, and whether the full-vocab argmax lies in the draft vocab.

    hidden [..., Ht] (after the final norm), lm_head_weight [V, Ht], t2d bool [V]. Returns fp32 logits
    [..., Vd] and a bool [...]; full-vocab logits exist only ``chunk_elements`` at a time.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    t2d = t2d.to(flat.device)
    rows = max(1, chunk_elements // lm_head_weight.shape[0])
    logits, in_draft = [], []
    for part in flat.split(rows):
        full = part @ lm_head_weight.T
        logits.append(full[:, t2d].float())
        in_draft.append(t2d[full.argmax(-1)])
    lead = hidden.shape[:-1]
    return torch.cat(logits).reshape(*lead, -1), torch.cat(in_draft).reshape(lead)


@torch.no_grad()
def target_argmax(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk_elements: int = LOGIT_CHUNK_ELEMENTS
) -> torch.Tensor:
    """The target's next token: hidden [..., Ht] (after the final norm) -> its argmax over the whole vocabulary,
    int64 [...]. Full-vocab logits exist only ``chunk_elements`` at a time, in the chunks ``draft_logits`` uses (so
    the argmax is the one of its logits, bit for bit): 8 bytes a position come out, never [..., V]."""
    flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head_weight.dtype)
    rows = max(1, chunk_elements // lm_head_weight.shape[0])
    return torch.cat([(part @ lm_head_weight.T).argmax(-1) for part in flat.split(rows)]).reshape(hidden.shape[:-1])


# What a training objective reads of the target at each position: its distribution over the draft vocabulary
# (``draft_logits``: [B, L, Vd] fp32 and the in-draft flags; EAGLE-3) or only its next token (``target_argmax``:
# [B, L] int64; the block drafters)
TargetReads = Literal["distribution", "argmax"]


@dataclass
class Features:
    aux: torch.Tensor  # [B, L, 3*Ht] in the target's dtype
    last_hidden: torch.Tensor  # [B, L, Ht] after the final norm
    target_logits: torch.Tensor | None = None  # [B, L, Vd] fp32: position t predicts token t+1
    target_in_draft: torch.Tensor | None = None  # [B, L] bool


class TargetFeatures:
    """Runs the frozen target on a batch and returns its aux states, final hidden state and draft-vocab logits."""

    def __init__(self, model, aux_layer_ids: list[int], t2d: torch.Tensor | None = None):
        self.model = model
        self.inner, self.layers, self.norm, self.lm_head = decoder_parts(model)
        n = len(self.layers)
        if len(aux_layer_ids) != 3 or not all(0 <= i < n for i in aux_layer_ids):
            raise UsageError(
                f"aux layer ids {aux_layer_ids} do not fit a target with {n} decoder layers",
                f"use three indices in [0, {n - 1}], e.g. the default {default_aux_layers(n)}",
            )
        self.aux_layer_ids = list(aux_layer_ids)
        self.t2d = t2d

    @property
    def hidden_size(self) -> int:
        return self.lm_head.in_features

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        with_logits: bool = True,
        position_ids: torch.Tensor | None = None,
    ) -> Features:
        """``position_ids`` (packed rows: 0 where each document starts) replace ``attention_mask``: transformers
        (>= 4.54) then masks attention to each document (its packed-sequence format); padding after the last
        document needs no mask, nothing real attends it."""
        captured: dict[int, torch.Tensor] = {}

        def tap(i):
            def hook(module, args, kwargs):
                captured[i] = args[0] if args else kwargs["hidden_states"]

            return hook

        handles = [self.layers[i].register_forward_pre_hook(tap(i), with_kwargs=True) for i in set(self.aux_layer_ids)]
        try:
            device = input_embedding(self.inner).weight.device
            if position_ids is not None:
                out = self.inner(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False)
            else:
                out = self.inner(
                    input_ids=input_ids.to(device),
                    attention_mask=None if attention_mask is None else attention_mask.to(device),
                    use_cache=False,
                )
        finally:
            for h in handles:
                h.remove()
        last = out.last_hidden_state
        aux = torch.cat([captured[i].to(last.device) for i in self.aux_layer_ids], dim=-1)
        feats = Features(aux=aux, last_hidden=last)
        if with_logits:
            if self.t2d is None:
                raise EaglekitError(
                    "TargetFeatures needs t2d to compute draft-vocab logits", "pass the vocab stage's t2d"
                )
            feats.target_logits, feats.target_in_draft = draft_logits(
                last, self.lm_head.weight.to(last.device), self.t2d
            )
        return feats

    @torch.no_grad()
    def argmax(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's next token at each position (``target_argmax``), without its [.., V] logits."""
        return target_argmax(last_hidden, self.lm_head.weight.to(last_hidden.device))


class TargetHead:
    """The target's lm_head alone, for offline features: final hidden [.., Ht] -> draft-vocab logits, in-draft flags."""

    def __init__(self, weight: torch.Tensor, t2d: torch.Tensor):
        self.weight, self.t2d = weight, t2d.to(weight.device)

    def to(self, device) -> TargetHead:
        return TargetHead(self.weight.to(device), self.t2d.to(device))

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_logits(last_hidden.to(self.weight.dtype), self.weight, self.t2d)

    def argmax(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's next token at each position (``target_argmax``), without its [.., V] logits."""
        return target_argmax(last_hidden, self.weight)


# ------------------------------------------------------------------------------- weights without the model


def _local_folder(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # lazy: heavy (huggingface_hub)

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))


def target_tensor_names(model: str) -> dict[str, str]:
    """Every tensor name of a target's safetensors checkpoint -> the file holding it (from the index alone)."""
    folder = _local_folder(model)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    if (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")  # safetensors 0.8 no longer iterates the handle
    raise EaglekitError(
        f"{folder} has no safetensors weights (model.safetensors or its index)",
        "convert the target to safetensors (save_pretrained(..., safe_serialization=True))",
    )


def read_target_tensors(model: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Read a few named tensors from a target's safetensors files without loading the model."""
    folder = _local_folder(model)
    weight_map = target_tensor_names(model)
    out = {}
    for name in names:
        if name not in weight_map:
            continue
        with safe_open(str(folder / weight_map[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _quantized_head_error(model: str, names: list[str]) -> EaglekitError | None:
    """A named error when the checkpoint's lm_head is quantized (packed INT4 etc.) rather than a dense tensor.

    Quantized targets (an INT4 MoE) usually keep lm_head dense — compressed-tensors lists it under
    ``quantization_config.ignore``, AWQ/GPTQ under ``modules_to_not_convert`` — and then it is read like any
    other tensor; offline training needs it dense.
    """
    packed = [n for n in names if n.startswith("lm_head.") and n != "lm_head.weight"]
    if "lm_head.weight" in names or not packed:
        return None
    try:
        qcfg = json.loads((_local_folder(model) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        qcfg = {}
    ignored = qcfg.get("ignore") or qcfg.get("modules_to_not_convert") or []
    return EaglekitError(
        f"{model}: lm_head is quantized in this checkpoint ({', '.join(sorted(packed)[:3])}; "
        f"quantization_config {qcfg.get('quant_method', '?')} does not list it under ignore: "
        f"{ignored or 'nothing is ignored'}), and offline training needs the dense lm_head",
        "use a checkpoint whose lm_head is kept dense (INT4 releases usually list it under "
        "quantization_config.ignore), or train with extract.mode: online",
    )


def read_final_norm(target_cfg: TargetConfig) -> FinalNorm:
    """The target's final norm, read by name (``model.norm.weight``) from its safetensors — never the model."""
    hf = target_hf_config(target_cfg)
    name = "model.norm.weight"
    tensors = read_target_tensors(target_cfg.model, [name])
    if name not in tensors:
        raise EaglekitError(
            f"{target_cfg.model}: no tensor {name} in its safetensors files",
            "eaglekit reads Llama/Qwen/DeepSeek-style checkpoints (model.norm, lm_head)",
        )
    eps = getattr(hf, "rms_norm_eps", None) or getattr(hf, "layer_norm_eps", None) or 1e-6
    return FinalNorm(tensors[name], float(eps), offset=getattr(hf, "model_type", "").startswith("gemma"))


class FinalNorm:
    """RMSNorm as the target's last layer applies it: ``w * x / rms(x)`` (Llama, Qwen, Mistral, DeepSeek, Kimi),
    or ``(1 + w) * ...`` (Gemma). Computed in fp32, returned in the input's dtype — as Hugging Face does."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: bool = False):
        self.weight, self.eps, self.offset = weight, eps, offset

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(x.device)
        if self.offset:
            return (h * (1.0 + w.float())).to(x.dtype)
        return w * h.to(x.dtype) if w.dtype == x.dtype else (w.float() * h).to(x.dtype)


def embedding_and_head(source: nn.Module | str, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens.weight [V, Ht], lm_head.weight [V, Ht]) of a loaded target, or read from its folder / hub id."""
    if isinstance(source, nn.Module):
        inner, _, _, lm_head = decoder_parts(source)
        return input_embedding(inner).weight.detach(), lm_head.weight.detach()
    tensors = read_target_tensors(source, ["model.embed_tokens.weight", "lm_head.weight"])
    quantized = _quantized_head_error(source, list(target_tensor_names(source)))
    if quantized is not None:
        raise quantized
    if "model.embed_tokens.weight" not in tensors:
        raise EaglekitError(
            f"{source}: no tensor model.embed_tokens.weight in its safetensors files",
            "eaglekit reads Llama/Qwen-style checkpoints (model.embed_tokens, lm_head)",
        )
    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight")
    if head is None:
        tied = getattr(
            target_hf_config(TargetConfig(model=source, trust_remote_code=trust_remote_code)),
            "tie_word_embeddings",
            False,
        )
        if not tied:
            raise EaglekitError(
                f"{source}: no lm_head.weight and the embeddings are not tied",
                "check that the target's weights are complete",
            )
        head = embed
    return embed, head

"""Which kernels a TTT step runs: the reference (CPU, and the definition) or the fused GPU path.

``ttt_loss`` takes a ``StepKernels``; ``step_kernels`` builds one from the train config for a device:
  attention   "reference": ttt.py's own attention (blockwise, exact, any device);
              "sdpa": unpacked step 0 through scaled_dot_product_attention (FlashAttention), the rest reference;
              "flex": also packed step 0 and every draft step through flex attention (``training/attention.py``).
              "auto": flex on CUDA, reference elsewhere.
  head_loss   "reference": loss.py's chunk function as it is; "compiled": the same function through
              ``torch.compile``, so the elementwise work over each [rows, Vd] chunk of logits (log-sum-exp, the
              soft cross-entropy, argmax, the gradient of the logits) runs as a few fused kernels instead of a
              dozen passes over memory. It compiles whatever ``head_loss_chunk`` computes, so a loss
              defined there is fused too. "auto": compiled on CUDA, reference elsewhere.
``compile_drafter`` (train.ttt.compile) compiles the drafter's per-step pieces (the fc fusion, the layer before and
after attention) so their norms, RoPE and SwiGLU fuse around the GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from eaglekit.drafters.eagle3.head_loss import ChunkFn, head_loss_chunk
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.errors import UsageError
from eaglekit.training.context_parallel import ContextGroup

AttentionKind = Literal["reference", "sdpa", "flex"]


@dataclass(frozen=True)
class StepKernels:
    attention: AttentionKind = "reference"
    head_chunk: ChunkFn | None = None  # loss.py's chunk function, compiled; None: as it is
    # recompute each TTT step's layer in backward instead of keeping its activations (train.ttt.activation_checkpointing)
    checkpoint_steps: bool = False
    # the ranks that split each row's positions (train.context_parallel, training/context_parallel.py); None: one
    context: ContextGroup | None = None

    def describe(self) -> str:
        return (
            f"attention {self.attention}, head loss {'compiled' if self.head_chunk else 'reference'}"
            + (", TTT steps recomputed in backward" if self.checkpoint_steps else "")
            + (f", each row split over {self.context.size} ranks" if self.context else "")
        )


REFERENCE = StepKernels()


def compiled_chunk(backend: str = "inductor") -> ChunkFn:
    """loss.py's head_loss_chunk under torch.compile (dynamic: the last chunk of a step is shorter)."""
    return torch.compile(head_loss_chunk, dynamic=True, backend=backend)


def step_kernels(
    attention: str,
    head_loss: str,
    device: torch.device,
    checkpoint_steps: bool = False,
    context: ContextGroup | None = None,
) -> StepKernels:
    """The kernels of train.ttt.attention and train.ttt.head_loss on ``device`` ("auto": fused on CUDA)."""
    cuda = device.type == "cuda"
    if attention == "auto":
        attention = "flex" if cuda else "reference"
    if head_loss == "auto":
        head_loss = "compiled" if cuda else "reference"
    if attention == "flex" and not cuda:
        raise UsageError(
            f"train.ttt.attention is flex but training runs on {device.type}: flex attention has no backward there",
            "set train.ttt.attention to auto, reference or sdpa",
        )
    if attention not in ("reference", "sdpa", "flex"):
        raise UsageError(
            f"train.ttt.attention {attention!r} is not one of auto, reference, sdpa, flex", "fix the config"
        )
    if head_loss not in ("reference", "compiled"):
        raise UsageError(f"train.ttt.head_loss {head_loss!r} is not one of auto, reference, compiled", "fix the config")
    chunk = compiled_chunk() if head_loss == "compiled" else None
    return StepKernels(attention, chunk, checkpoint_steps, context)  # type: ignore[arg-type]


def compile_drafter(drafter: Eagle3Drafter, backend: str = "inductor") -> Eagle3Drafter:
    """Compile, in place, the drafter methods ttt_loss calls per step; parameters and state dict stay as they are.

    dynamic: the rows of every draft step change from batch to batch.
    """
    pieces: list[tuple[torch.nn.Module, str]] = [(drafter, "fuse"), (drafter, "next_feature")]
    pieces += [(layer, name) for layer in drafter.decoder_layers for name in ("qkv", "finish")]
    for owner, name in pieces:
        setattr(owner, name, torch.compile(getattr(owner, name), dynamic=True, backend=backend))
    return drafter

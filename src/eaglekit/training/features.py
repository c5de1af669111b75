"""Where the TTT inputs of a batch come from: the live target (online), or stored rows plus the target's head — read
from offline shards, or streamed from the vLLM servers (``training/stream.py`` assembles those batches)."""

from __future__ import annotations

from pathlib import Path

import torch

from eaglekit.data.shards import FeatureStore, Rows, decode, plan_shards
from eaglekit.data.tokens import TokenStore
from eaglekit.errors import EaglekitError
from eaglekit.model.target import TargetFeatures, TargetHead, TargetReads
from eaglekit.training.data import Batch


class Features:
    """Turns a token batch into TTT inputs: from the live target (online) or from shards + lm_head (offline)."""

    packing_checked = False  # online packing: the target's features of a packed document were checked once

    def __init__(
        self,
        run_dir: Path,
        t2d: torch.Tensor,
        device: torch.device,
        aux_ids: list[int],
        aux_dtype: torch.dtype,
        target_model: torch.nn.Module | None = None,
        head: torch.Tensor | None = None,
        streamed: bool = False,
    ):
        self.device, self.aux_dtype = device, aux_dtype
        self.store: FeatureStore | None = None
        self.target: TargetFeatures | None = None
        self.head: TargetHead | None = None
        if target_model is not None:
            self.target = TargetFeatures(target_model, aux_ids, t2d)
            return
        if head is None:
            raise ValueError("offline features need the target's lm_head to rebuild its distribution")
        self.head = TargetHead(head.to(device, torch.float32 if device.type == "cpu" else head.dtype), t2d)
        if streamed:  # the batches arrive with their rows (training/stream.py); the data order is the online one
            return
        self.store = FeatureStore(run_dir / "extract")
        if self.store.index.get("aux_layer_ids") not in (None, aux_ids):
            raise EaglekitError(
                f"the offline features tap layers {self.store.index['aux_layer_ids']}, this config {aux_ids}",
                "rerun extraction: `eaglekit run CONFIG --from extract --force`",
            )

    def __call__(self, batch: Batch, reads: TargetReads = "distribution") -> tuple:
        """(aux, input_ids, target, loss_mask, attention_mask, target_in_draft, position_ids) on the device.

        ``reads``: what the objective reads of the target. "distribution": ``target`` is its logits over the draft
        vocabulary [B, L, Vd] fp32, with the in-draft flags; "argmax": ``target`` is its next token [B, L] int64
        and the flags None — a block drafter's vocabulary is the target's whole one, whose fp32 logits would be
        the step's largest tensor (4 V bytes a position) for 8 bytes of use."""
        b = batch.to(self.device)
        in_draft: torch.Tensor | None = None
        if self.target is not None:
            f = self.target(
                b.input_ids, b.attention_mask, with_logits=reads == "distribution", position_ids=b.position_ids
            )
            if b.position_ids is not None and not self.packing_checked:
                self.check_packed_features(b, f)
            aux = f.aux.to(self.device)
            if reads == "argmax":
                target = self.target.argmax(f.last_hidden)
            else:
                assert f.target_logits is not None and f.target_in_draft is not None  # asked with_logits
                target, in_draft = f.target_logits, f.target_in_draft.to(self.device)
            target = target.to(self.device)
        else:  # stored or streamed rows (bf16, or fp8 with its scales) are decoded on the device: half the bytes travel
            assert self.head is not None and b.aux is not None and b.last_hidden is not None  # offline rows carry both
            aux, last = decode(Rows(b.aux, b.last_hidden, b.scale_exp), self.head.weight.dtype)
            if reads == "argmax":
                target = self.head.argmax(last)
            else:
                target, in_draft = self.head(last)
        return aux.to(self.aux_dtype), b.input_ids, target, b.loss_mask, b.attention_mask, in_draft, b.position_ids

    def check_packed_features(self, b: Batch, packed) -> None:
        """Once: the target's features of a packed row's second document equal those of the document alone.

        transformers keeps packed documents apart by reading position_ids; a model whose attention ignores
        them (custom code) would let every document attend the ones before it, silently.
        """
        assert self.target is not None and b.position_ids is not None  # called on packed online rows only
        for row in range(b.position_ids.shape[0]):
            starts = (b.position_ids[row] == 0).nonzero().squeeze(1).tolist()
            real = int(b.attention_mask[row].sum())
            if len(starts) >= 2 and starts[1] < real:
                end = starts[2] if len(starts) > 2 else real
                alone = self.target(b.input_ids[row : row + 1, starts[1] : end], with_logits=False)
                got, want = packed.aux[row, starts[1] : end].float(), alone.aux[0].float()
                error = float((got - want).norm() / want.norm().clamp(min=1e-12))
                if error > 0.05:
                    raise EaglekitError(
                        f"train.packing: the target's features of a packed document differ from the same document "
                        f"alone (relative error {error:.3f}): its attention does not keep packed documents apart "
                        "(transformers does that from position_ids for its own Llama/Qwen-style models)",
                        "set train.packing: false, or extract features offline (extract.mode: offline), which runs "
                        "every document alone",
                    )
                self.packing_checked = True
                return

    def blocks(self, store: TokenStore, lengths: list[int], shard_tokens: int) -> list[list[int]]:
        """Token-store indices per data block: the feature shards offline, the same plan online and streamed (one data
        order for all three)."""
        if self.store is None:
            return plan_shards(lengths, shard_tokens)
        position = {sid: i for i, sid in enumerate(store.ids)}
        missing = [sid for sid in store.ids if sid not in self.store]
        if missing:
            raise EaglekitError(
                f"{len(missing)} prepared samples have no offline features (e.g. {missing[0]!r})",
                "the features are from other prepared tokens: rerun extraction: "
                "`eaglekit run CONFIG --from extract --force`",
            )
        return [[position[sid] for sid in ids if sid in position] for ids in self.store.shard_members()]

"""The local backend of the generate stage: the target generates in this process with ``transformers``.

Prompts are rendered with the target's chat template (``add_generation_prompt=True``, plus any
``generate.extra_body.chat_template_kwargs``, as a server would), batched with left padding, sorted by
length so a batch wastes little on padding. Generation stops at the template's end-of-turn token. The
reply is decoded with its special tokens kept (think tags may be special in some vocabularies) and then
goes through the same record builder as a server's reply, so reasoning is split by the one inline splitter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

from eaglekit.config import RunConfig
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer
from eaglekit.data.prompts import PromptRecord
from eaglekit.data.responses import make_record
from eaglekit.errors import EaglekitError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class LocalGenerator:
    def __init__(self, cfg: RunConfig):
        from transformers import AutoModelForCausalLM  # lazy: heavy (transformers)

        self.cfg, t = cfg, cfg.target
        self.tokenizer = load_tokenizer(t.model, t.chat_template, t.trust_remote_code)
        self.template_kwargs = dict(cfg.generate.extra_body.get("chat_template_kwargs") or {})
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                t.model, dtype=DTYPES[t.dtype], device_map=t.device_map, trust_remote_code=t.trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise EaglekitError(
                f"cannot load the target {t.model}: {err}", "set target.model to a complete Hugging Face model folder"
            ) from None
        if t.device_map is None and torch.cuda.is_available():
            self.model.to("cuda")  # type: ignore[arg-type]  # transformers' decorated .to() stub takes the model as argument
        self.model.eval()
        self.stop_ids = sorted(end_of_turn_token_ids(self.tokenizer))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def generate(self, batch: list[tuple[PromptRecord, list[int]]]) -> list[tuple[dict, list[str]]]:
        """(record, fields_seen) for each (prompt, its token ids) of one batch."""
        g = self.cfg.generate
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (_, ids) in enumerate(batch):  # left padding: every row's prompt ends at the last column
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        device = self.model.device
        # Seeded from the batch's ids rather than its position, so a resumed run samples the same way.
        seed = int.from_bytes(hashlib.sha1(f"{g.seed}:{batch[0][0].id}".encode()).digest()[:4], "big")
        torch.manual_seed(seed)
        sampling = (
            dict(do_sample=True, temperature=g.temperature, top_p=g.top_p)
            if g.temperature > 0
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        )
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=g.max_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            **sampling,
        )
        results = []
        for (prompt, ids), row in zip(batch, out[:, width:].tolist(), strict=False):
            stop_at = next((k for k, tok in enumerate(row) if tok in self.stop_ids), None)
            generated = row if stop_at is None else row[: stop_at + 1]  # the end-of-turn token is part of the reply
            text = self.tokenizer.decode(generated if stop_at is None else generated[:-1], skip_special_tokens=False)
            results.append(
                make_record(
                    prompt.id,
                    prompt.messages,
                    {"role": "assistant", "content": text},
                    finish_reason="length" if stop_at is None else "stop",
                    prompt_tokens=len(ids),
                    completion_tokens=len(generated),
                    model=self.cfg.target.model,
                    server=None,
                    token_ids=generated,
                )
            )
        return results


def generate_local(cfg: RunConfig, pending: Iterable[PromptRecord], add: Callable[[dict, list[str]], None]) -> None:
    """Generate every pending prompt in batches; ``add`` takes each finished record as its batch completes."""
    gen = LocalGenerator(cfg)
    rendered = sorted(((p, gen.prompt_ids(p.messages)) for p in pending), key=lambda x: len(x[1]))
    size = cfg.generate.batch_size
    for start in range(0, len(rendered), size):
        for record, seen in gen.generate(rendered[start : start + size]):
            add(record, seen)

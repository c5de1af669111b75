"""Rendering a prompt plus the target's reply with the target's chat template, into token ids and a loss mask.

The drafter learns to predict what the target generates, so the loss mask covers exactly the tokens the
target emitted after the generation prompt: the reasoning block, the answer and the end-of-turn token,
and not what the template writes after it (ChatML's trailing newline belongs to the next prompt).

Token ids are what the target saw and produced at inference: servers render the prompt to text and
tokenize it with ``add_special_tokens=False`` (the template writes any BOS itself), then the model emits
the reply token by token. So the prompt, the reply and the template's tail are tokenized separately and
concatenated; tokenizing the whole text at once can merge tokens across the prompt/reply boundary
(e.g. a prompt ending in a space), which the target never saw.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from eaglekit.errors import EaglekitError, UsageError
from eaglekit.hub import model_folder

# Message fields through which chat templates take an assistant turn's reasoning, in order of preference.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# Tokens that end an assistant turn in the common template families (only those in the vocab count).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<｜end▁of▁sentence｜>",
)
_SENTINEL = "eaglekit-reasoning-probe-7f3a"
_THINK_TAG = re.compile(r"</?[\w:-]*think>")


@dataclass
class RenderedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the assistant reply's tokens (end-of-turn included), 0 elsewhere
    prompt_tokens: int  # input_ids[:prompt_tokens] is the generation prompt exactly as the target saw it


def load_tokenizer(model_path: str, chat_template_override: str | None = None, trust_remote_code: bool = False):
    """The target's tokenizer, with ``chat_template_override`` (a Jinja string or a file holding one) applied."""
    from transformers import AutoTokenizer  # lazy: heavy (transformers)

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, JSON errors… for a broken folder
        raise UsageError(
            f"cannot load the tokenizer of {model_path}: {type(err).__name__}: {err}",
            "set target.model to a local model folder (or a hub id already in the cache)",
        ) from None
    if chat_template_override:
        tokenizer.chat_template = _read_template(chat_template_override)
    if not tokenizer.chat_template:
        raise UsageError(
            f"the tokenizer of {model_path} has no chat template",
            "set target.chat_template to the Jinja template the target is served with (a string or a file)",
        )
    return tokenizer


def _read_template(value: str) -> str:
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise UsageError(
            f"target.chat_template: {value!r} is neither a Jinja template nor an existing file",
            "give the template text itself or the path of a .jinja file",
        )
    return path.read_text(encoding="utf-8")


def template_text(tokenizer) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError as err:  # no template, or several with no default
        raise UsageError(
            f"cannot pick the tokenizer's chat template: {err}",
            "set target.chat_template to the Jinja template the target is served with",
        ) from None


def template_has_think_tags(tokenizer) -> bool:
    """Whether the chat template writes think tags (``<think>``, ``</think>``, ``<seed:think>``…): a reasoning model."""
    return bool(_THINK_TAG.search(template_text(tokenizer)))


_field_cache: dict[str, str | None] = {}


def reasoning_field(tokenizer) -> str | None:
    """The assistant-message field the template renders reasoning from, or None (reasoning then goes inline).

    Found by rendering one reply whose reasoning is a sentinel string; cached per template text.
    """
    template = template_text(tokenizer)
    if template not in _field_cache:
        _field_cache[template] = None
        for name in REASONING_FIELDS:
            probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong", name: _SENTINEL}]
            try:
                text = tokenizer.apply_chat_template(probe, tokenize=False)
            except TemplateError:
                continue  # the render below will report a broken template with its context
            if _SENTINEL in text:
                _field_cache[template] = name
                break
    return _field_cache[template]


def end_of_turn_token_ids(tokenizer) -> set[int]:
    """Ids of the tokens that end an assistant turn: the EOS plus the known end-of-turn tokens in the vocab."""
    return {tokenizer.convert_tokens_to_ids(t) for t in _end_of_turn_strings(tokenizer)}


def _end_of_turn_strings(tokenizer) -> list[str]:
    # End-of-turn markers are added tokens (a SentencePiece '</s>' that is not is the EOS, caught below);
    # get_vocab() would rebuild a 150k-entry dict on every call.
    added = tokenizer.added_tokens_encoder
    names = [t for t in END_OF_TURN_TOKENS if t in added]
    if tokenizer.eos_token and tokenizer.eos_token not in names:
        names.append(tokenizer.eos_token)
    return names


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except TemplateError as err:
        raise EaglekitError(
            f"the chat template failed to render a conversation ({len(messages)} messages): {err}",
            "check target.chat_template, or fix the roles/order of the prompt's turns",
        ) from None


def _tokenize(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def prompt_token_ids(tokenizer, messages: list[dict], template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The generation prompt's token ids as a server makes them: the chat template rendered with
    ``add_generation_prompt``, tokenized with ``add_special_tokens=False`` (the template writes any BOS)."""
    return _tokenize(tokenizer, _render(tokenizer, messages, True, template_kwargs or {}))


SHOWN_TOKENS = 8  # tokens of each rendering shown from where they first differ


def served_prompt_mismatch(
    tokenizer, local_ids: list[int], served_count: int | None, served_ids: list[int] | None = None
) -> str | None:
    """How a server's rendering of a prompt differs from the local one (``local_ids``, from ``prompt_token_ids``),
    judged by the token ids it returned (``prompt_token_ids``, its /tokenize) or else by its count
    (``usage.prompt_tokens``); None when they agree or the server says neither."""
    if served_ids is not None:
        if list(served_ids) == local_ids:
            return None
        at = next((i for i, (a, b) in enumerate(zip(served_ids, local_ids, strict=False)) if a != b), None)
        at = min(len(served_ids), len(local_ids)) if at is None else at

        def shown(ids: list[int]) -> str:
            pieces = [tokenizer.decode([i]) for i in ids[at : at + SHOWN_TOKENS]]
            return (repr(pieces) if pieces else "[] (it ends there)") + ("…" if len(ids) > at + SHOWN_TOKENS else "")

        return (
            f"the server's prompt has {len(served_ids)} tokens, the local rendering with the target's chat template "
            f"{len(local_ids)}; they first differ at token {at}: server {shown(list(served_ids))}, local "
            f"{shown(local_ids)}"
        )
    if served_count is None or served_count == len(local_ids):
        return None
    more = served_count - len(local_ids)
    return (
        f"the server counts {served_count} prompt tokens (usage.prompt_tokens), the local rendering with the "
        f"target's chat template {len(local_ids)} ({'+' if more > 0 else ''}{more}): the server renders the prompt "
        "another way (an added system turn, another template revision)"
    )


TEMPLATE_REMEDY = (
    "serve the target with the chat template that target.chat_template (or the tokenizer's own) holds — vLLM: "
    "--chat-template FILE, and no system prompt added on the way — or set target.chat_template to the template the "
    "server uses: training must see each prompt as the target saw it"
)


def render_sample(
    tokenizer,
    prompt_messages: list[dict],
    reasoning: str | None,
    content: str,
    template_kwargs: dict[str, Any] | None = None,
) -> RenderedSample:
    """Token ids of prompt + reply and the mask of the reply's tokens.

    ``reasoning`` goes in the message field the template renders (see ``reasoning_field``), otherwise
    inline as ``<think>\\n…\\n</think>\\n\\n`` before ``content``. ``template_kwargs`` (e.g.
    ``enable_thinking``) must be the ones the target was served with.
    """
    template_kwargs = template_kwargs or {}
    reasoning = reasoning or ""
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    field = reasoning_field(tokenizer)
    if field:
        reply[field] = reasoning
    elif reasoning.strip():
        reply["content"] = f"<think>\n{reasoning}\n</think>\n\n{content}"

    prompt = _render(tokenizer, prompt_messages, True, template_kwargs)  # what prompt_token_ids tokenizes
    full = _render(tokenizer, [*prompt_messages, reply], False, template_kwargs)
    if not full.startswith(prompt):
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), min(len(prompt), len(full))
        )
        raise EaglekitError(
            "the chat template is not prefix-consistent: the generation prompt is not the start of the rendered "
            f"conversation (they differ at character {at}: prompt has {prompt[at : at + 40]!r}, conversation has "
            f"{full[at : at + 40]!r}), so the reply's tokens cannot be located",
            "set target.chat_template to a template whose add_generation_prompt output begins the assistant turn "
            "exactly as the full rendering does (e.g. one that keeps the final turn's reasoning)",
        )
    suffix = full[len(prompt) :]

    # The reply ends at the first end-of-turn token after the answer; templates may trim the text, so
    # anchor on the stripped answer and check the template kept what the target wrote.
    anchor = 0
    for label, text in (("reasoning", reasoning.strip()), ("answer", content.strip())):
        if not text:
            continue
        pos = suffix.find(text, anchor)
        if pos < 0:
            raise EaglekitError(
                f"the chat template drops the final assistant turn's {label}: {text[:60]!r} is not in "
                f"the rendered reply {suffix[:120]!r}",
                "set target.chat_template to a template that renders the final turn's reasoning "
                "(or inline <think> text) and answer unchanged",
            )
        anchor = pos + len(text)
    ends = [p + len(t) for t in _end_of_turn_strings(tokenizer) if (p := suffix.find(t, anchor)) >= 0]
    reply_end = min(ends) if ends else len(suffix.rstrip())

    prompt_ids = _tokenize(tokenizer, prompt)
    reply_ids = _tokenize(tokenizer, suffix[:reply_end])
    tail_ids = _tokenize(tokenizer, suffix[reply_end:])
    bos = tokenizer.bos_token_id
    if bos is not None and prompt_ids[:2] == [bos, bos]:
        raise EaglekitError(
            "the rendered prompt starts with two BOS tokens",
            "use a chat template that writes the BOS once (the tokenizer adds none here)",
        )
    return RenderedSample(
        input_ids=prompt_ids + reply_ids + tail_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(reply_ids) + [0] * len(tail_ids),
        prompt_tokens=len(prompt_ids),
    )


def use_generated_tokens(
    tokenizer, input_ids: list[int], loss_mask: list[int], generated: list[int] | None
) -> tuple[list[int], list[int], bool]:
    """Put the tokens the target actually generated in place of the re-tokenized reply.

    A model can emit a non-canonical tokenization of its own text (e.g. "5" + "5" where the tokenizer
    would merge "55"); re-tokenizing the decoded text then trains the drafter on ids the target never
    produces. When the server returned the ids (``completion_token_ids``) and they decode to exactly the
    masked reply, they replace it. Returns (ids, mask, replaced).
    """
    if not generated or 1 not in loss_mask:
        return input_ids, loss_mask, False
    first = loss_mask.index(1)
    end = len(loss_mask) - loss_mask[::-1].index(1)
    reply = input_ids[first:end]
    if reply == list(generated) or tokenizer.decode(reply) != tokenizer.decode(list(generated)):
        return input_ids, loss_mask, False
    ids = input_ids[:first] + list(generated) + input_ids[end:]
    mask = loss_mask[:first] + [1] * len(generated) + loss_mask[end:]
    return ids, mask, True


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(model: str, template: str | None, trust_remote_code: bool):
    return load_tokenizer(model, template, trust_remote_code)


def local_target_tokenizer(cfg):
    """The target's tokenizer (``target.*`` of a RunConfig) when its files are here — a folder, or a hub id's cached
    snapshot — else None: never a download."""
    t = cfg.target
    folder = model_folder(t.model)
    if folder is None or not folder.is_dir():
        return None
    return _load_tokenizer_cached(str(folder), t.chat_template, t.trust_remote_code)


class ServedPrompts:
    """A server's rendering of each prompt against the local one (the target's tokenizer and chat template, with
    generate's ``chat_template_kwargs``), as generate's smoke request and every response judge it."""

    def __init__(self, cfg):
        try:
            self.tokenizer = local_target_tokenizer(cfg)
        except EaglekitError:
            self.tokenizer = None  # the reasoning and prompt checks name the tokenizer's problem
        self.kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or {}

    def local_ids(self, messages: list[dict]) -> list[int] | None:
        """The prompt's ids as rendered here; None without the tokenizer or when the template refuses the prompt
        (the prompt checks name that)."""
        if self.tokenizer is None:
            return None
        try:
            return prompt_token_ids(self.tokenizer, messages, self.kwargs)
        except EaglekitError:
            return None

    def mismatch(self, local: list[int], response: dict, served_ids: list[int] | None = None) -> str | None:
        """How the server's prompt differs from ``local``: by ``served_ids`` (e.g. from its /tokenize), else the ids
        the response carries (vLLM's ``prompt_token_ids``), else its ``usage.prompt_tokens``."""
        ids = served_ids if served_ids is not None else response_prompt_ids(response)
        count = (response.get("usage") or {}).get("prompt_tokens")
        return served_prompt_mismatch(self.tokenizer, local, count if isinstance(count, int) else None, ids)

    def check(self, messages: list[dict], response: dict) -> str | None:
        """A response's prompt against the local rendering (None also where nothing can be compared)."""
        local = self.local_ids(messages)
        return None if local is None else self.mismatch(local, response)


def response_prompt_ids(response: dict) -> list[int] | None:
    """The prompt's token ids a chat completion carries (vLLM's ``prompt_token_ids`` with return_token_ids)."""
    ids = response.get("prompt_token_ids")
    return ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None

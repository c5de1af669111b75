"""Golden loss mask on the built-in tiny target's own tokenizer and chat template: exactly the reply —
think block, answer and <|im_end|> — is masked, and nothing of the prompt or the trailing newline."""

from __future__ import annotations

from eaglekit.data.chat import load_tokenizer, render_sample, template_has_think_tags, use_generated_tokens


def test_tiny_target_mask_covers_exactly_the_reply(tiny_target):
    tok = load_tokenizer(str(tiny_target))
    assert template_has_think_tags(tok)
    prompt = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": "What is 12 + 30?"}]
    sample = render_sample(tok, prompt, "2 + 0 = 2. 1 + 3 = 4.", "42")
    ids, mask = sample.input_ids, sample.loss_mask
    masked = [i for i, m in zip(ids, mask, strict=False) if m]
    assert tok.decode(masked) == "<think>\n2 + 0 = 2. 1 + 3 = 4.\n</think>\n\n42<|im_end|>"
    # The mask is one contiguous span that ends at <|im_end|>; the prompt (with the generation prompt) is unmasked.
    first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
    assert all(mask[first : last + 1]) and not any(mask[:first]) and not any(mask[last + 1 :])
    assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
    assert ids[last] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids[last + 1 :]) == "\n"


def test_generated_ids_replace_a_different_retokenization(tiny_target):
    tok = load_tokenizer(str(tiny_target))
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    sample = render_sample(tok, prompt, "the apple and the banana", "done")
    first = sample.loss_mask.index(1)
    reply = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=False) if m]
    # The same text spelled with one token per character: what a model may emit, never what re-tokenizing gives.
    merged = next(i for i, t in enumerate(reply) if len(tok.decode([t])) > 1)
    spelled = (
        reply[:merged]
        + [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(reply[merged])]
        + reply[merged + 1 :]
    )
    assert tok.decode(spelled) == tok.decode(reply) and spelled != reply
    ids, mask, replaced = use_generated_tokens(tok, sample.input_ids, sample.loss_mask, spelled)
    assert replaced and ids[:first] == sample.input_ids[:first]
    assert [t for t, m in zip(ids, mask, strict=False) if m] == spelled
    assert tok.decode(ids) == tok.decode(sample.input_ids)
    # Ids that do not spell the same text are never spliced in.
    assert use_generated_tokens(tok, sample.input_ids, sample.loss_mask, spelled[:-2])[2] is False

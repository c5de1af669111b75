"""Golden loss masks: three chat template families rendered with a tiny byte-level tokenizer.

The tokenizer maps every character to one token (plus the chat special tokens and one merge, ' H', used
to show a prompt/reply boundary effect), so each expected span can be written as a literal string.
"""

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, processors
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from eaglekit.data.chat import (
    end_of_turn_token_ids,
    load_tokenizer,
    reasoning_field,
    render_sample,
    template_has_think_tags,
)
from eaglekit.errors import EaglekitError, UsageError

# In the spirit of Qwen3's template: reasoning_content (or inline <think>) is rendered only for assistant
# turns after the last user query; earlier turns keep only their answer.
QWEN3 = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

LLAMA3 = """
{%- for message in messages %}
    {%- set turn = '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' %}
    {%- if loop.index0 == 0 %}{%- set turn = bos_token + turn %}{%- endif %}
    {{- turn }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

CHATML = """
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIALS = [
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def build_tokenizer(template: str, bos: str | None, eos: str, add_bos: bool = False) -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["ĠH"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "H")]))
    tk.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tk.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    if add_bos:  # like the real Llama-3 tokenizer: add_special_tokens=True would put a second BOS in front
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))]
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The three tokenizers, saved as a model folder would hold them and loaded back with load_tokenizer."""
    root = tmp_path_factory.mktemp("tokenizers")
    specs = {
        "qwen3": (QWEN3, None, "<|im_end|>", False),
        "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
        "chatml": (CHATML, None, "<|im_end|>", False),
    }
    for name, spec in specs.items():
        build_tokenizer(*spec).save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def qwen3(saved):
    return load_tokenizer(str(saved / "qwen3"))


@pytest.fixture(scope="module")
def llama3(saved):
    return load_tokenizer(str(saved / "llama3"))


@pytest.fixture(scope="module")
def chatml(saved):
    return load_tokenizer(str(saved / "chatml"))


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def assert_golden(tok, sample, prompt: str, reply: str, tail: str, end_token: str):
    """input_ids spell prompt+reply+tail; the mask is exactly the reply; the reply ends with the end-of-turn token."""
    n_prompt, n_reply, n_tail = len(enc(tok, prompt)), len(enc(tok, reply)), len(enc(tok, tail))
    assert tok.decode(sample.input_ids, skip_special_tokens=False) == prompt + reply + tail
    assert sample.prompt_tokens == n_prompt
    assert sample.loss_mask == [0] * n_prompt + [1] * n_reply + [0] * n_tail
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=False) if m]
    assert tok.decode(masked, skip_special_tokens=False) == reply
    assert masked[-1] == tok.convert_tokens_to_ids(end_token)
    assert sample.input_ids[:n_prompt] == enc(tok, prompt)


# --- (a) Qwen3-style: reasoning_content, earlier turns' reasoning dropped --------------------------


def test_qwen3_single_turn_reasoning_goes_through_the_field(qwen3):
    assert reasoning_field(qwen3) == "reasoning_content"
    sample = render_sample(qwen3, [{"role": "user", "content": "Hi"}], "Let me think.", "Hello!")
    assert_golden(
        qwen3,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        reply="<think>\nLet me think.\n</think>\n\nHello!<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )
    assert sample.loss_mask[-1] == 0 and sample.input_ids[-1] == enc(qwen3, "\n")[0]


def test_qwen3_multi_turn_masks_only_the_final_reply(qwen3):
    prompt_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nHello"},
        {"role": "user", "content": "More?"},
    ]
    sample = render_sample(qwen3, prompt_messages, "Again.", "Sure.")
    assert_golden(
        qwen3,
        sample,
        prompt=(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n"
            "<|im_start|>assistant\n"
        ),
        reply="<think>\nAgain.\n</think>\n\nSure.<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )
    # The earlier assistant turn is context: none of its tokens are trained on.
    assert sum(sample.loss_mask) == len(enc(qwen3, "<think>\nAgain.\n</think>\n\nSure.<|im_end|>"))


def test_qwen3_empty_reasoning_renders_the_empty_think_block_as_reply(qwen3):
    sample = render_sample(qwen3, [{"role": "user", "content": "Hi"}], "", "Hello!")
    assert_golden(
        qwen3,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        reply="<think>\n\n</think>\n\nHello!<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )


def test_qwen3_enable_thinking_false_puts_the_empty_think_block_in_the_prompt(qwen3):
    sample = render_sample(
        qwen3, [{"role": "user", "content": "Hi"}], None, "Hello!", template_kwargs={"enable_thinking": False}
    )
    assert_golden(
        qwen3,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        reply="Hello!<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )


def test_reasoning_field_is_used_when_the_template_renders_it():
    # This template wraps reasoning_content its own way and never parses inline tags, so putting the
    # reasoning inline instead would show up as '<think>\n…\n</think>\n\n' in the reply.
    template = CHATML.replace(
        "'\\n' + message.content",
        "'\\n' + ('<think>' + message.reasoning_content + '</think>' if message.reasoning_content else '') + message.content",
    )
    tok = build_tokenizer(template, None, "<|im_end|>")
    assert reasoning_field(tok) == "reasoning_content"
    sample = render_sample(tok, [{"role": "user", "content": "Hi"}], "R", "C")
    assert_golden(
        tok,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        reply="<think>R</think>C<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )


# --- (b) Llama-3-style: BOS in the template, no reasoning field --------------------------------------


def test_llama3_reasoning_inline_single_bos_no_tail(llama3):
    assert reasoning_field(llama3) is None
    prompt_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    sample = render_sample(llama3, prompt_messages, "Hmm.", "Hello!")
    assert_golden(
        llama3,
        sample,
        prompt=(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        reply="<think>\nHmm.\n</think>\n\nHello!<|eot_id|>",
        tail="",
        end_token="<|eot_id|>",
    )
    bos = llama3.bos_token_id
    assert sample.input_ids[0] == bos and sample.input_ids.count(bos) == 1
    # The tokenizer itself would add a second BOS: the point of add_special_tokens=False.
    assert llama3("<|begin_of_text|>x")["input_ids"][:2] == [bos, bos]


def test_llama3_multi_turn_without_reasoning(llama3):
    prompt_messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Bye"},
    ]
    sample = render_sample(llama3, prompt_messages, "", "Ciao")
    assert_golden(
        llama3,
        sample,
        prompt=(
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        reply="Ciao<|eot_id|>",
        tail="",
        end_token="<|eot_id|>",
    )


# --- (c) plain ChatML: no reasoning support -----------------------------------------------------------


def test_chatml_without_reasoning(chatml):
    assert reasoning_field(chatml) is None
    sample = render_sample(chatml, [{"role": "user", "content": "Hi"}], None, "Hello!")
    assert_golden(
        chatml,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        reply="Hello!<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )


def test_chatml_reasoning_inline_and_multi_turn(chatml):
    prompt_messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    sample = render_sample(chatml, prompt_messages, "think", "D")
    assert_golden(
        chatml,
        sample,
        prompt=(
            "<|im_start|>user\nA<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n"
            "<|im_start|>user\nC<|im_end|>\n<|im_start|>assistant\n"
        ),
        reply="<think>\nthink\n</think>\n\nD<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )


@pytest.mark.parametrize("name,expected", [("qwen3", True), ("llama3", False), ("chatml", False)])
def test_template_has_think_tags(saved, name, expected):
    assert template_has_think_tags(load_tokenizer(str(saved / name))) is expected


def test_end_of_turn_token_ids(qwen3, llama3):
    assert qwen3.convert_tokens_to_ids("<|im_end|>") in end_of_turn_token_ids(qwen3)
    assert llama3.convert_tokens_to_ids("<|eot_id|>") in end_of_turn_token_ids(llama3)
    assert qwen3.convert_tokens_to_ids("<|im_start|>") not in end_of_turn_token_ids(qwen3)


# --- token boundaries and template problems -------------------------------------------------------------


def test_prompt_ids_are_the_generation_prompt_tokenized_alone():
    # The prompt ends in a space and the reply starts with 'H': tokenized whole, ' H' merges across the
    # boundary; the target saw the prompt tokenized alone and generated 'H' on its own.
    template = (
        "{%- for m in messages %}{{- m.role + ': ' + m.content + '<|im_end|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
    )
    tok = build_tokenizer(template, None, "<|im_end|>")
    sample = render_sample(tok, [{"role": "user", "content": "q"}], None, "Hi")
    prompt = "user: q<|im_end|>assistant: "
    assert enc(tok, prompt + "Hi<|im_end|>") != enc(tok, prompt) + enc(tok, "Hi<|im_end|>")  # the merge is real
    assert sample.input_ids == enc(tok, prompt) + enc(tok, "Hi<|im_end|>")
    assert sample.loss_mask == [0] * len(enc(tok, prompt)) + [1] * len(enc(tok, "Hi<|im_end|>"))


def test_think_tag_opened_by_the_generation_prompt_is_not_trained_on():
    # Like Qwen3-Thinking-2507: the generation prompt ends with '<think>\n', so the model wrote only
    # the reasoning after it; the opening tag is prompt.
    template = CHATML.replace(
        "'<|im_start|>assistant\\n' }}{%- endif %}", "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    )
    tok = build_tokenizer(template, None, "<|im_end|>")
    sample = render_sample(tok, [{"role": "user", "content": "Hi"}], "r", "Hello")
    assert_golden(
        tok,
        sample,
        prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
        reply="r\n</think>\n\nHello<|im_end|>",
        tail="\n",
        end_token="<|im_end|>",
    )
    # Without reasoning the rendered turn has no think block, so the generation prompt is not its start.
    with pytest.raises(EaglekitError, match="not prefix-consistent"):
        render_sample(tok, [{"role": "user", "content": "Hi"}], "", "Hello")


def test_template_that_drops_the_reasoning_is_an_error():
    # Like DeepSeek-R1's template: strips '...</think>' from every assistant turn, the final one included.
    template = CHATML.replace("message.content + '<|im_end|>", "message.content.split('</think>')[-1] + '<|im_end|>")
    tok = build_tokenizer(template, None, "<|im_end|>")
    with pytest.raises(EaglekitError, match="drops the final assistant turn's reasoning"):
        render_sample(tok, [{"role": "user", "content": "Hi"}], "secret plan", "Hello")


# --- load_tokenizer -------------------------------------------------------------------------------------


def test_load_tokenizer_override_from_string_and_file(saved, tmp_path):
    tok = load_tokenizer(str(saved / "chatml"), chat_template_override=QWEN3)
    assert template_has_think_tags(tok) and reasoning_field(tok) == "reasoning_content"
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3)
    tok = load_tokenizer(str(saved / "qwen3"), chat_template_override=str(path))
    assert not template_has_think_tags(tok)


def test_load_tokenizer_errors(saved, tmp_path):
    bare = build_tokenizer(CHATML, None, "<|im_end|>")
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    with pytest.raises(UsageError, match="no chat template") as err:
        load_tokenizer(str(tmp_path / "bare"))
    assert "target.chat_template" in err.value.remedy
    with pytest.raises(UsageError, match="neither a Jinja template nor an existing file"):
        load_tokenizer(str(saved / "chatml"), chat_template_override=str(tmp_path / "missing.jinja"))
    with pytest.raises(UsageError, match="cannot load the tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-model"))

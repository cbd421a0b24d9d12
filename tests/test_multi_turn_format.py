"""TurnFormat: the tokens between turns come from the tokenizer's chat template (a
ChatML one and a Qwen-style one that wraps tool responses in a user turn), the EOS the
model wrote is not repeated, and long contents are cut to an exact token count."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rayrl.models.tiny import build_tiny_model
from rayrl.rollout.agent.format import TurnFormat, TurnFormatError

# A template in the style of Qwen2.5's: consecutive tool messages share one user turn,
# each wrapped in <tool_response> tags.
TOOL_RESPONSE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("fmt") / "tiny", vocab_size=320)
    return AutoTokenizer.from_pretrained(path)


def text_of(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


def test_chatml_tool_turns(tokenizer):
    fmt = TurnFormat(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    obs = fmt.observation([{"role": "tool", "content": "42"}], last_token=im_end)
    assert (
        text_of(tokenizer, obs.tokens)
        == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    # A turn that ended on a stop string (no EOS) gets the closing too.
    closed = fmt.observation([{"role": "tool", "content": "42"}], last_token=None)
    assert text_of(tokenizer, closed.tokens).startswith("<|im_end|>\n<|im_start|>tool\n42")
    user = fmt.observation([{"role": "user", "content": "try again"}], last_token=im_end)
    assert (
        text_of(tokenizer, user.tokens)
        == "\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen_style_tool_responses_share_a_user_turn(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = TOOL_RESPONSE_TEMPLATE
    fmt = TurnFormat(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    obs = fmt.observation(messages, last_token=im_end)
    assert text_of(tokenizer, obs.tokens) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
        "\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.pieces(("tool",))[0] == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_long_contents_are_cut_to_the_token_limit(tokenizer, side):
    fmt = TurnFormat(tokenizer, max_message_tokens=40, truncate_side=side)
    long = " ".join(f"w{i}" for i in range(300))
    obs = fmt.observation([{"role": "tool", "content": long}], last_token=None)
    full = TurnFormat(tokenizer).observation([{"role": "tool", "content": "X"}], last_token=None)
    assert len(obs.tokens) == len(full.tokens) - len(tokenizer.encode("X")) + 40
    assert obs.truncated == 1 and "(truncated)" in obs.messages[0]["content"]
    shown = obs.messages[0]["content"]
    assert shown.startswith("w0 ") == (side != "left")
    assert shown.endswith("w299") == (side != "right")
    short = fmt.observation([{"role": "tool", "content": "w1 w2"}], last_token=None)
    assert short.truncated == 0 and short.messages[0]["content"] == "w1 w2"


def test_templates_that_cannot_render_tool_turns_fail_clearly(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{%- endif %}"
        "{{- m.content }}{%- endfor %}"
    )
    with pytest.raises(TurnFormatError, match="cannot render \\['tool'\\] messages"):
        TurnFormat(tokenizer).pieces(("tool",))
    with pytest.raises(ValueError, match="truncate_side"):
        TurnFormat(tokenizer, truncate_side="top")


def test_decode_keeps_special_tokens_for_parsers_that_read_them(tokenizer):
    """A parser made of special tokens (gpt-oss's harmony) reads them; others do not."""
    tokens = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert "<|im_end|>" not in TurnFormat(tokenizer).decode(tokens)
    assert TurnFormat(tokenizer, keep_special_tokens=True).decode(tokens).endswith("<|im_end|>")

"""A small, real byte-level BPE tokenizer trained on the spot, for tiny test models.

`train_tokenizer` trains a Qwen2 tokenizer with the `tokenizers` library: byte-level BPE
(every string encodes; NFC text decodes back exactly), digits split one per token, the
ChatML special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, and a ChatML chat
template. With no corpus it trains on a built-in corpus of arithmetic, GSM8K-style
answers ("#### 42") and short English, so prompts of the bundled math tasks tokenize
sensibly. Nothing is downloaded. The same inputs always give the same tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Split before byte-level BPE, as Qwen2 does: English contractions, letter runs (with one
# leading non-letter), single digits, punctuation runs, newlines, and whitespace. Training
# must use the same pipeline (NFC, this split, byte level) as `Qwen2Tokenizer`, which is
# what `AutoTokenizer` rebuilds from the saved vocabulary and merges.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen2 renders it: one `<|im_start|>role\ncontent<|im_end|>\n` block per
# message, then an open assistant block when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = (
    "the a an and or of to in on at for with from by is are was were be has have had "
    "do does did will can how many much more less each every total left per times "
    "what who which when then so if not all some half twice first second third "
    "he she they we you it his her their our your this that these those "
    "buys sells gives gets makes eats reads walks runs pays earns saves spends "
    "apples books cookies dollars eggs hours minutes pages pencils marbles tickets "
    "boxes bags cars days weeks friends students cats dogs cups cakes coins trees "
    "Tom Anna Ben Lily Sam Mia Max Zoe Leo Ivy "
    "answer question problem step think number numbers equation equals sum product "
    "difference result final let us solve check use using create target "
    "user assistant system please reason put within"
)
_WORDS = tuple(_WORD_TEXT.split())

_STORY = (
    "{name} has {a} {item}. {pronoun} buys {b} more. How many {item} does {pronoun_l} have now?",
    "{name} had {c} {item} and gave {b} to a friend. How many {item} are left?",
    "Each box holds {a} {item}. {name} has {b} boxes. How many {item} are there in total?",
    "{name} reads {a} pages every day for {b} days. How many pages does {pronoun_l} read?",
    "A shop sells {item} for {a} dollars each. {name} buys {b}. How much does {pronoun_l} pay?",
)
_NAMES = {
    "Tom": "He",
    "Ben": "He",
    "Sam": "He",
    "Max": "He",
    "Leo": "He",
    "Anna": "She",
    "Lily": "She",
    "Mia": "She",
    "Zoe": "She",
    "Ivy": "She",
}
_ITEMS = ("apples", "books", "cookies", "eggs", "pencils", "marbles", "tickets", "coins")


def _arithmetic_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if rng.random() < 0.5:
        return f"{a}{op}{b}={value}"
    return f"{a} {op} {b} = {value}"


def _story_line(rng: random.Random) -> str:
    name = rng.choice(sorted(_NAMES))
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    template_id = rng.randrange(len(_STORY))
    fields = dict(name=name, a=a, b=b, c=a + b, item=rng.choice(_ITEMS))
    fields.update(pronoun=_NAMES[name], pronoun_l=_NAMES[name].lower())
    question = _STORY[template_id].format(**fields)
    answer = {0: a + b, 1: a, 2: a * b, 3: a * b, 4: a * b}[template_id]
    reply = f"Let's think step by step. The answer is {answer}.\n#### {answer}"
    return f"user\n{question}\nassistant\n{reply}"


def _words_line(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."


def _countdown_line(rng: random.Random) -> str:
    nums = [rng.randint(1, 50) for _ in range(3)]
    target = nums[0] + nums[1] - nums[2]
    return (
        f"Using the numbers {nums}, create an equation that equals {target}.\n"
        f"<think>{nums[0]} + {nums[1]} = {nums[0] + nums[1]}</think>\n"
        f"<answer>{nums[0]} + {nums[1]} - {nums[2]}</answer>"
    )


def default_corpus(seed: int = 0, lines: int = 400) -> list[str]:
    """The built-in training corpus: `lines` lines drawn deterministically from `seed`.

    A mix of digits, arithmetic ("12+7=19"), short English sentences, GSM8K-style word
    problems ending in "#### 42", and countdown-style equations with <think>/<answer>.
    """
    rng = random.Random(seed)
    out = [" ".join("0123456789"), "0123456789", " ".join(_WORDS)]
    makers = (_arithmetic_line, _story_line, _words_line, _countdown_line)
    while len(out) < lines:
        out.append(makers[len(out) % len(makers)](rng))
    return out


def _bpe_tokenizer(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def train_tokenizer(
    corpus: Iterable[str] | None = None,
    alphabet: str | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    model_max_length: int = 2048,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template.

    Args:
        corpus: training text, one string per line or document. None uses
            `default_corpus(seed)` (math, GSM8K-style answers, short English).
        alphabet: characters that must each be one token (e.g. a synthetic task's
            symbols). ASCII characters already are; others are added as whole tokens.
        vocab_size: target vocabulary size, counting the 256 byte tokens and the three
            special tokens. A small corpus may run out of merges first; the tokenizer
            is then smaller. Must be at least 259.
        seed: seed of the built-in corpus; unused when `corpus` is given.
        model_max_length: the tokenizer's `model_max_length`.

    Returns:
        A `Qwen2Tokenizer` (a `PreTrainedTokenizerFast`) whose eos and pad token are
        `<|endoftext|>`, with no bos or unk token, as Qwen2's; special-token ids are
        0, 1, 2 in the order of SPECIAL_TOKENS. Text is NFC-normalised, so decode(encode(s))
        == s for NFC text (all ASCII text included). Same arguments, same tokenizer.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"train_tokenizer: vocab_size={vocab_size} is too small; a byte-level tokenizer "
            f"needs at least {minimum} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)."
        )
    lines = default_corpus(seed) if corpus is None else [str(x) for x in corpus]
    bpe = json.loads(_bpe_tokenizer(lines, vocab_size).to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=bpe["vocab"],
        merges=[tuple(pair) for pair in bpe["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    extra = sorted({ch for ch in alphabet or "" if not ch.isascii()})
    tokenizer.add_tokens([AddedToken(ch, normalized=False) for ch in extra])
    return tokenizer

"""`TextCodec`: the tokenizer's own tokens and texts, through its Rust backend."""

from __future__ import annotations

import random

import pytest

from rayrl.models.tokenizer import train_tokenizer
from rayrl.rollout.text_codec import TextCodec


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def _texts(tokenizer) -> list[str]:
    rng = random.Random(0)
    alphabet = "abc xyz 0123456789 {}[]\":,\n\t<>/_-+*=()'é数🙂"
    specials = tokenizer.all_special_tokens
    texts = ["", " ", '<tool_call>\n{"name": "calculator"}\n</tool_call>']
    for _ in range(200):
        words = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), rng.choice(specials))
        texts.append("".join(words))
    return texts


def test_the_backend_gives_the_tokenizers_tokens_and_texts(tokenizer):
    codec = TextCodec(tokenizer)
    assert codec.fast
    for text in _texts(tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert codec.encode(text) == ids, text
        for skip in (False, True):
            assert codec.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_truncation_set_on_the_shared_backend_cuts_nothing(tokenizer):
    text = "12 + 34 = 46 and more words " * 20
    whole = tokenizer.encode(text, add_special_tokens=False)
    shared = tokenizer.backend_tokenizer
    shared.enable_truncation(max_length=4)  # as a batch call with max_length leaves it
    try:
        codec = TextCodec(tokenizer)
        assert codec.fast and codec.encode(text) == whole
    finally:
        shared.no_truncation()
    shared.enable_truncation(max_length=4)  # set after the codec was made
    try:
        assert codec.encode(text) == whole
    finally:
        shared.no_truncation()


def test_a_tokenizer_that_cleans_up_spaces_or_disagrees_is_called_itself(tokenizer):
    cleaning = train_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    assert not TextCodec(cleaning).fast

    class Shifted:  # a tokenizer whose encode is not its backend's
        backend_tokenizer = tokenizer.backend_tokenizer
        all_special_tokens = tokenizer.all_special_tokens

        def encode(self, text, **kwargs):
            return [t + 1 for t in tokenizer.encode(text, **kwargs)]

        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    codec = TextCodec(Shifted())
    assert not codec.fast
    assert codec.encode("ab") == [t + 1 for t in tokenizer.encode("ab", add_special_tokens=False)]


def test_decode_batch_gives_the_tokenizers_batch_decode(tokenizer):
    """As the reward decodes a step's responses: ids of the texts, ids past the
    tokenizer's vocabulary (a random-weight model samples them), special tokens."""
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in _texts(tokenizer)]
    rng = random.Random(1)
    rows += [[rng.randrange(0, len(tokenizer) + 5000) for _ in range(50)] for _ in range(20)]
    for codec in (TextCodec(tokenizer), _slow(tokenizer)):
        for skip in (False, True):
            assert codec.decode_batch(rows, skip) == tokenizer.batch_decode(
                rows, skip_special_tokens=skip
            )
    assert TextCodec(tokenizer).decode_batch([], True) == []


def _slow(tokenizer) -> TextCodec:
    codec = TextCodec(tokenizer)
    codec.backend = None  # as where the backend disagreed
    return codec

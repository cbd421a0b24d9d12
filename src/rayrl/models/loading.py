"""Loading a model directory's tokenizer, refusing one that has none.

Given a directory without tokenizer files, transformers builds a tokenizer that knows
no tokens and says nothing; every prompt then encodes to nothing useful and the run
sets every row aside. `load_tokenizer` checks the directory first and names it, the
files it looked for, and the key to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Any one of these makes a directory a tokenizer's (fast, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


class TokenizerMissingError(FileNotFoundError):
    """A model directory has no tokenizer files."""


def load_tokenizer(
    path: str | Path, *, key: str, trust_remote_code: bool = False, chat_template: str | None = None
) -> Any:
    """The tokenizer of the model directory (or hub name) `path`, its chat template
    replaced by `chat_template` when given (verl's `model.custom_chat_template`); `key`
    is the config key that named it, for the error when a local directory holds no
    tokenizer."""
    from transformers import AutoTokenizer

    local = Path(path)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerMissingError(
            f"{key}={path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer into that directory (tokenizer.save_pretrained(DIR)) or "
            "point actor_rollout_ref.model.tokenizer_path (rayrl sft: model.partial_pretrain) "
            "at a directory that has one"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if len(tokenizer) == 0:
        raise TokenizerMissingError(f"{key}={path}: the tokenizer loaded there has no tokens")
    return with_chat_template(tokenizer, chat_template)


def with_chat_template(tokenizer: Any, chat_template: str | None) -> Any:
    """`tokenizer` with its chat template replaced by `chat_template` (None: kept)."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer

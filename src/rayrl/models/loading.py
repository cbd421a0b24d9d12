"""Loading a model directory's tokenizer, refusing one that has none, and checking
model paths before anything loads them.

A model path that names no directory and is no hub name ("/data/qwen" mistyped) would
reach transformers, which answers with a hub error about repository ids;
`check_model_path` names the key, the path and what to give instead.

Given a directory without tokenizer files, transformers builds a tokenizer that knows
no tokens and says nothing; every prompt then encodes to nothing useful and the run
sets every row aside. `load_tokenizer` checks the directory first and names it, the
files it looked for, and the key to set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Any one of these makes a directory a tokenizer's (fast, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


# A Hugging Face hub model name: "name" or "namespace/name"
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class TokenizerMissingError(FileNotFoundError):
    """A model directory has no tokenizer files."""


class ModelPathError(FileNotFoundError):
    """A model path is neither a local model directory nor a hub model name."""


def check_model_path(path: str | Path, *, key: str) -> None:
    """Raise ModelPathError naming `key` when `path` is no local directory and cannot
    be a hub model name either (an absolute or home path, `..`, more than one `/`)."""
    text = str(path)
    local = Path(text)
    if text.startswith("~"):
        raise ModelPathError(
            f"{key}={text}: '~' is not expanded in a key=value argument (the shell leaves "
            f"it); give the whole path, {Path(text).expanduser()}"
        )
    if local.is_dir():
        return
    if local.exists():
        raise ModelPathError(
            f"{key}={text} is a file, not a model directory; give the directory that "
            "holds config.json, the weights and the tokenizer"
        )
    if HUB_NAME.match(text) and ".." not in text:
        return  # a hub name: transformers fetches it (or says why it cannot)
    raise ModelPathError(
        f"{key}={text}: no such directory (working directory {Path.cwd()}); give a "
        "local model directory (config.json, weights, tokenizer) or a Hugging Face hub "
        "name such as Qwen/Qwen2.5-0.5B-Instruct"
    )


def load_tokenizer(
    path: str | Path, *, key: str, trust_remote_code: bool = False, chat_template: str | None = None
) -> Any:
    """The tokenizer of the model directory (or hub name) `path`, its chat template
    replaced by `chat_template` when given (verl's `model.custom_chat_template`); `key`
    is the config key that named it, for the error when a local directory holds no
    tokenizer."""
    from transformers import AutoTokenizer

    check_model_path(path, key=key)
    local = Path(path)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerMissingError(
            f"{key}={path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer into that directory (tokenizer.save_pretrained(DIR)) or "
            "point actor_rollout_ref.model.tokenizer_path (rayrl sft: model.partial_pretrain) "
            "at a directory that has one"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except OSError as err:
        if local.is_dir():
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelPathError(
            f"{key}={path} is no local directory, and loading it from the Hugging Face hub "
            f"failed: {first} Download it first (huggingface-cli download {path} --local-dir "
            f"DIR) and give DIR"
        ) from err
    if len(tokenizer) == 0:
        raise TokenizerMissingError(f"{key}={path}: the tokenizer loaded there has no tokens")
    return with_chat_template(tokenizer, chat_template)


def with_chat_template(tokenizer: Any, chat_template: str | None) -> Any:
    """`tokenizer` with its chat template replaced by `chat_template` (None: kept)."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer

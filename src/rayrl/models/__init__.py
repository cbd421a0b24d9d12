"""Models: tiny random-weight Qwen2 models and the tokenizer factory they use.

`build_tiny_model` writes a Hugging Face directory that loads offline;
`train_tokenizer` trains the byte-level BPE tokenizer with ChatML tokens it ships with.
The names load on first use: `rayrl.models.loading`, which every trainer imports,
must not pull in transformers' model classes.
"""

import importlib
from typing import Any

_WHERE = {
    "TinySpec": "rayrl.models.tiny",
    "build_tiny_model": "rayrl.models.tiny",
    "count_parameters": "rayrl.models.tiny",
    "reference_05b": "rayrl.models.tiny",
    "train_tokenizer": "rayrl.models.tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rayrl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)

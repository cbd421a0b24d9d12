"""The EOS ids a rollout ends on and the pad id written after it, for any engine.

Both are read from the model's generation config first, then its config, then the
tokenizer, the order transformers' ``generate()`` uses.
"""

from __future__ import annotations

__all__ = ["eos_ids", "pad_id"]


def eos_ids(generation_config, config, tokenizer) -> tuple[int, ...]:
    """EOS ids from the generation config, else the model config, else the tokenizer."""
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(int(i) for i in ([eos] if isinstance(eos, int) else eos))
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def pad_id(generation_config, tokenizer, eos: tuple[int, ...], where: str) -> int:
    """The id written after a response ends: the tokenizer's pad, the model's, or EOS."""
    for source in (tokenizer, generation_config):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    if eos:
        return eos[0]
    raise ValueError(
        f"{where}: the model and tokenizer define neither a pad nor an EOS token id; "
        "set tokenizer.pad_token_id."
    )

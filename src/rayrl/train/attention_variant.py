"""A layer's attention variant as transformers hands it to an attention function: its
sliding window and its attention-logit soft-cap.

transformers' attention modules pass ``sliding_window`` (Mistral, Qwen2/3, Gemma 2/3,
Phi-3, OLMo 3, Cohere 2: on the layers that slide, None elsewhere) and ``softcap``
(Gemma 2's ``attn_logit_softcapping``) as keyword arguments of every call. Its own
``sdpa`` path gets the window from the mask alone and has no soft-cap; the training
engine's packed attention (`rayrl.train.attention`) reads both here, so a packed row
attends as transformers' eager path does. In transformers' window of ``w``, a query
sees its own key and the ``w - 1`` before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Variant"]


@dataclass(frozen=True)
class Variant:
    """``window``: how many keys a query sees, its own included (None: all before it);
    ``softcap``: attention logits become ``softcap * tanh(logits / softcap)``."""

    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, module: nn.Module, kwargs: dict[str, Any]) -> Variant:
        """The variant of the call transformers makes on ``module`` with ``kwargs``;
        refuses what the engine's attention cannot compute (attention sinks)."""
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError(
                f"{type(module).__name__}: attention sinks (s_aux, as gpt-oss has) are not "
                "computed by rayrl's packed attention; train this model with "
                "actor_rollout_ref.model.use_remove_padding=false "
                "actor_rollout_ref.model.attn_implementation=eager"
            )
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        return cls(int(window) if window else None, float(softcap) if softcap else None)

    def binds(self, keys: int) -> bool:
        """Whether the window hides any of ``keys`` keys from the last query."""
        return self.window is not None and self.window < keys

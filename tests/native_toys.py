"""Shared pieces of the native engine's tests: a tiny model's weights made to vary
token to token, and a turn driver whose tools answer at once."""

from __future__ import annotations

import numpy as np
import torch

from rayrl.rollout.turns import Continuation


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Larger random weights (and non-zero biases), so greedy outputs vary token to token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.15 if p.dim() == 2 else 0.3))
    return model.eval()


class InstantTurns:
    """A turn driver whose tools answer at once: three observations of three tokens per
    sample (fewer where the response limit leaves no room), then the episode ends."""

    def __init__(self, limit: int) -> None:
        self.limit, self.turns, self.ready = limit, {}, []

    def turn_ended(self, sample: int, response: np.ndarray) -> None:
        self.turns[sample] = self.turns.get(sample, 0) + 1
        if self.turns[sample] > 3:
            self.ready.append(Continuation(sample, None, True))
        elif len(response) + 3 >= self.limit:
            self.ready.append(Continuation(sample, None, False))
        else:
            self.ready.append(Continuation(sample, [5, 6, 7]))

    def take_ready(self, wait: bool) -> list[Continuation]:
        ready, self.ready = self.ready, []
        return ready


def gpt2_config():
    """A family the native engine does not run."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)

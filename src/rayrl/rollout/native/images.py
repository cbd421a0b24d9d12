"""A prompt's images as the native engine runs them: the vision tower's features to
splice into its prefill, its M-RoPE positions, and the key its KV blocks are cached by.

A vision-language prompt (Qwen2-VL, Qwen2.5-VL) holds one placeholder token per merged
image patch. Its prefill embeds the tokens, puts the image features at the
placeholders (`features_in`), and rotates every token by its three positions (time,
height, width: `rope_positions`, from the model's own ``get_rope_index``). A token past
the prompt (a sampled one, recomputed after a preemption, or appended by a turn) is text:
its three positions are its index plus ``delta`` (the model's ``rope_deltas``), which is
all the decode steps need (`Scheduler.decode_inputs`), CUDA graphs included.

Two prompts whose tokens match but whose images differ must never share KV blocks: a
prompt with images chains its prefix-cache hashes from ``salt``, a hash of its pixels
and grids (`rayrl.rollout.native.prefix_cache`), so only the same tokens with the same
images find each other's blocks; a text prompt's salt is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

__all__ = ["PromptImages", "salt_of"]


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images (module docstring).

    Attributes:
        positions: ``[3, L]`` int64, the M-RoPE positions of the prompt's L tokens.
        delta: the prompt's ``rope_deltas``: token ``i >= L`` sits at ``i + delta``.
        features: ``[K, hidden]`` the vision tower's merged features, in placeholder
            order, on the engine's device and in its dtype.
        placeholders: ``[K]`` the indices of the image tokens in the prompt, ascending.
        salt: the prefix cache's key beside the tokens (`salt_of`).
    """

    positions: np.ndarray
    delta: int
    features: Tensor
    placeholders: np.ndarray
    salt: int

    def rope_positions(self, start: int, count: int) -> np.ndarray:
        """``[3, count]`` positions of the tokens ``start .. start + count`` of the job
        (prompt, then text after it)."""
        end, length = start + count, self.positions.shape[1]
        inside = self.positions[:, start : min(end, length)]
        after = np.arange(max(start, length), end, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(after, (3, len(after)))], axis=1)

    def features_in(self, start: int, count: int) -> tuple[np.ndarray, Tensor]:
        """The placeholders among the tokens ``start .. start + count``: their offsets
        from ``start``, and their features' rows."""
        lo, hi = np.searchsorted(self.placeholders, [start, start + count])
        return self.placeholders[lo:hi] - start, self.features[lo:hi]


def salt_of(pixel_values: Tensor, grid: Tensor) -> int:
    """A prompt's images as one nonzero int: a hash of its pixels' and grids' bytes (equal
    images, equal salt, within the process; a text prompt's salt is 0)."""
    pixels = pixel_values.detach().cpu().contiguous().numpy().tobytes()
    grids = grid.detach().cpu().contiguous().numpy().tobytes()
    return hash((pixels, grids)) or 1

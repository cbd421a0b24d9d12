"""The native engine's vision side of a vision-language model (Qwen2-VL, Qwen2.5-VL):
transformers' own vision tower (patch embedding, blocks, merger) with the checkpoint's
weights, and what it makes of a batch of prompts' images (`images.PromptImages`).

The tower and the position rule are the model's: `VisionEncoder` builds the model's
multimodal core (``model.model``) on the meta device, so that it holds no language
model, and gives it a real tower; its ``get_image_features`` and ``get_rope_index``
(`rayrl.models.vision_language`, which the training forward uses too) then run as they
do for the model's own users. The language model is the engine's
(`rayrl.rollout.native.families.qwen2_vl`).

Weights arrive by transformers' names, from disk (``visual.*``, ``model.layers.*``) or
from the training model in memory (``model.visual.*``, ``model.language_model.*``):
`take` copies the tower's into it (every sync: a trained tower's, or its merger's, new
weights reach the rollout) and passes the language model's on under the names the
engine's weights have (``model.layers.*``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from rayrl.models.vision_language import image_features, rope_index, stack_images
from rayrl.rollout.native.images import PromptImages, salt_of

__all__ = ["VisionEncoder"]

TOWER = "model.visual."  # the tower's names as the engine lists them (in memory)
TOWER_NAMES = (TOWER, "visual.")  # in memory, on disk
TEXT_IN_MEMORY = "model.language_model."  # -> "model." (the names on disk)
WHERE = "NativeRolloutEngine"


class VisionEncoder:
    """The model's vision tower on ``device`` in ``dtype`` (module docstring)."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModel

        with torch.device("meta"):  # the core's structure only: no language model's memory
            core = AutoModel.from_config(config)
        tower = type(core.visual)._from_config(config.vision_config)
        core.visual = tower.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.core, self.device = core, torch.device(device)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self._params = dict(core.visual.named_parameters())
        self.copied = 0  # tower tensors copied by `take` so far

    @property
    def names(self) -> list[str]:
        """The tower's parameter names, as transformers names them in memory."""
        return [TOWER + name for name in self._params]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params.values())

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def take(
        self, pairs: Iterable[tuple[str, Tensor]], seen: list[str]
    ) -> Iterator[tuple[str, Tensor]]:
        """Copy the tower's tensors of ``pairs`` into it (noting their `names` in
        ``seen``); yield the others, the language model's under their names on disk."""
        for name, tensor in pairs:
            prefix = next((p for p in TOWER_NAMES if name.startswith(p)), None)
            if prefix is None:
                if name.startswith(TEXT_IN_MEMORY):
                    name = "model." + name[len(TEXT_IN_MEMORY) :]
                yield name, tensor
                continue
            key = name[len(prefix) :]
            param = self._params.get(key)
            if param is None:
                close = difflib.get_close_matches(TOWER + key, self.names, n=3)
                raise KeyError(
                    f"{WHERE}: the vision tower has no tensor {name!r}; closest: {close}"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{WHERE}: {name!r} has shape {tuple(tensor.shape)} but the vision tower's "
                    f"is {tuple(param.shape)}; pass the whole (unsharded) tensor"
                )
            param.copy_(tensor.detach())
            seen.append(TOWER + key)
            self.copied += 1

    # ------------------------------------------------------------------ images
    @torch.inference_mode()
    def prompt_images(
        self, prompts: Sequence[np.ndarray], rows: Sequence[Mapping[str, Tensor] | None]
    ) -> list[PromptImages | None]:
        """Each prompt's images (None for a text prompt) from its row's
        ``multi_modal_inputs``: the tower runs once over all of them, in row order."""
        marked = [np.asarray(p) == self.image_token_id for p in prompts]
        for i, row in enumerate(rows):
            if marked[i].any() and not row:
                raise ValueError(
                    f"{WHERE}.generate: prompt {i} holds {int(marked[i].sum())} image tokens "
                    "but no images; send the prompt rows' multi_modal_inputs column "
                    "(rayrl.data.dataset collates it)"
                )
        stacked = stack_images(rows)
        if stacked is None:
            return [None] * len(prompts)
        pixels = stacked["pixel_values"].to(self.device)
        features = image_features(self.core, pixels, stacked["image_grid_thw"].to(self.device))
        out: list[PromptImages | None] = []
        offset = 0
        for i, row in enumerate(rows):
            if not row:
                out.append(None)
                continue
            grid = torch.as_tensor(row["image_grid_thw"])
            count = int(grid.prod(-1).sum()) // self.merge**2
            out.append(self._one(i, prompts[i], marked[i], row, features[offset : offset + count]))
            offset += count
        return out

    def _one(
        self, i: int, prompt: np.ndarray, marked: np.ndarray, row: Mapping, features: Tensor
    ) -> PromptImages:
        """Prompt ``i``'s `PromptImages` (its ``features`` cut from the batch's)."""
        if int(marked.sum()) != len(features):
            raise ValueError(
                f"{WHERE}.generate: prompt {i} holds {int(marked.sum())} image tokens but its "
                f"images make {len(features)} features: its multi_modal_inputs are not the "
                "images its ids were made with (were the rows cut or reordered apart from "
                "that column?)"
            )
        grid = torch.as_tensor(row["image_grid_thw"])
        ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64))[None]
        positions, delta = rope_index(self.core, ids, torch.from_numpy(marked)[None], grid)
        return PromptImages(
            positions=positions[:, 0].cpu().numpy().astype(np.int64),
            delta=int(delta.reshape(-1)[0]),
            features=features,
            placeholders=np.flatnonzero(marked).astype(np.int64),
            salt=salt_of(torch.as_tensor(row["pixel_values"]), grid),
        )

"""Shared pieces of the tests of multi-turn episodes with images (issue 48).

A random tiny vision-language model writes no tool calls, so `LookEnvironment` answers
every assistant turn with the built-in ``look`` tool's view of the episode's image (the
real tool, through the real tool session: a region, cropped and resized, shown as an
image with a line of text), until the rollout's turn limits end the episode. Loaded by
file path (`ENVIRONMENT`), it runs in Ray workers too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rayrl.batch import Batch
from rayrl.envs import Environment, StepResult
from rayrl.envs.parsers import ToolCall
from rayrl.models.vision_language import RESPONSE_IMAGES, multimodal_core

ENVIRONMENT = f"{Path(__file__).resolve().parent / 'vision_turn_cases.py'}:LookEnvironment"
REGIONS = ("left", "top", "right", "bottom")


class LookEnvironment(Environment):
    """Every turn answered with ``look`` at the next region (module docstring)."""

    def reset(self, episode) -> None:
        super().reset(episode)
        self.session = self.toolbox.session(episode.tools_kwargs)
        self.turn = 0

    def step(self, conversation: list[dict[str, Any]], message: str) -> StepResult:
        region = REGIONS[self.turn % len(REGIONS)]
        self.turn += 1
        call = ToolCall("look", {"region": region}, raw=f"look({region})")
        results = self.session.run([call])
        observation = [{"role": "tool", "name": n, "content": c} for n, c in results]
        return StepResult(observation, assistant={"role": "assistant", "content": message})

    def close(self) -> dict[str, float]:
        return self.session.close()

    @property
    def events(self):
        return list(self.session.events)


def reference_episode_log_probs(model, batch: Batch, row: int, image_token_id: int):
    """Row ``row``'s response log-probs (fp32) from transformers' own pieces, one whole
    sequence: its real tokens, every image of the episode (the prompt's and the
    observations') put at the placeholders (the prompt's image tokens and the
    observations' columns; a sampled image token is none) and the model's own
    ``get_rope_index`` positions: what the rollout and the training forwards must both
    compute."""
    mask = batch["attention_mask"][row].bool()
    ids = batch["input_ids"][row][mask][None]
    width = batch["responses"].shape[1]
    prompt = int(batch["attention_mask"][row, :-width].sum())
    images = dict(batch.non_tensors["multi_modal_inputs"][row])
    marks = torch.zeros_like(ids, dtype=torch.bool)
    marks[0, :prompt] = ids[0, :prompt] == image_token_id
    marks[0, prompt + images.pop(RESPONSE_IMAGES, torch.zeros(0, dtype=torch.long))] = True
    core = multimodal_core(model)
    with torch.no_grad():
        embeds = core.get_input_embeddings()(ids)
        if images:
            features = core.get_image_features(images["pixel_values"], images["image_grid_thw"])
            features = torch.cat(features.pooler_output)
            embeds = embeds.masked_scatter(marks[..., None].expand_as(embeds), features)
        positions, _ = core.get_rope_index(
            ids, mm_token_type_ids=marks.int(), image_grid_thw=images.get("image_grid_thw")
        )
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0].float()
    log_probs = torch.log_softmax(logits, -1)
    return log_probs[prompt - 1 : -1].gather(-1, ids[0, prompt:, None])[:, 0]


def ending_turns_often(model_dir: Path, out: Path, share: float = 0.05) -> Path:
    """A copy of ``model_dir`` at ``out`` whose generation config makes every
    ``1 / share``-th id an EOS id (a random tiny model then ends its turns often, so its
    episodes have several turns); the vision token ids stay plain."""
    import shutil

    from transformers import AutoConfig, GenerationConfig

    shutil.copytree(model_dir, out)
    config = AutoConfig.from_pretrained(out)
    vision = {config.image_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vocab = config.get_text_config().vocab_size
    ids = [i for i in range(3, vocab, max(1, round(1 / share))) if i not in vision]
    generation = GenerationConfig.from_pretrained(out)
    generation.eos_token_id = ids
    generation.save_pretrained(out)
    return out

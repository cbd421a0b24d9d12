"""Multi-turn episodes of a vision-language model whose tool shows it images (issue 48):
the prompt's images and the ``look`` tool's (the real tool, through the real tool
session and the model's image processor) are fed to the hf engine's requests with
M-RoPE positions kept across turns, so the rollout's log-probs are transformers' own on
the whole episode; the trained tokens are the episode's record (the token check); the
training engine's log-probs of the response tokens, padded and packed, are the
rollout's, and without the observations' images they are not. Qwen2.5-VL and Qwen2-VL.
What a tool returns becomes the observation's image parts (rayrl's `ToolResult.images`,
verl's `ToolResponse.image`), which a text-only model's format refuses, named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rayrl.config.multi_turn import MultiTurnConfig
from rayrl.data.vision import load_vision_processor
from rayrl.envs.builtin.look import SIDE
from rayrl.models.vision_language import IMAGE_INPUTS, RESPONSE_IMAGES
from rayrl.rollout.agent.rollout import MultiTurnRollout, multi_turn_metrics
from rayrl.rollout.hf.engine import HFRolloutEngine
from rayrl.rollout.sampling import SamplingParams
from rayrl.train.engine import TrainEngine
from rayrl.trainer.episodes import token_check
from vision_cases import mixed_rows, png, prompts, qwen2_vl_model, sharp_vision_model
from vision_turn_cases import ENVIRONMENT, reference_episode_log_probs

TOLERANCE = 1e-3  # the brief's bound on |actor - rollout| log-probs, fp32 (they agree to 1e-5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-turns")
    sharp = sharp_vision_model(root)
    return {"qwen2_5_vl": sharp, "qwen2_vl": qwen2_vl_model(root, sharp)}


def _episodes(model_dir):
    """Two episodes per mixed prompt (one image, none, two), each turn answered by the
    look tool at the row's own image (an image of 64 x 96 pixels), three turns at most."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = mixed_rows()
    for i, row in enumerate(rows):
        look = {"create_kwargs": {"image": png(64, 96, 10 + i)}}
        row["extra_info"] = {"tools_kwargs": {"look": look}}
    _, batch = prompts(model_dir, rows)
    rollout = MultiTurnRollout(
        HFRolloutEngine(model=model, tokenizer=tokenizer),
        ["look"],
        MultiTurnConfig(enable=True, max_assistant_turns=3),
        environment=ENVIRONMENT,
        vision=load_vision_processor(model_dir, tokenizer, backend="pil"),
    )
    # a turn ends at a common letter (a random tiny model seldom draws its EOS)
    sampling = SamplingParams(n=2, max_new_tokens=120, temperature=1.0, seed=3, stop=("e",))
    out = rollout.generate(batch, sampling)
    out["prompts"] = batch["input_ids"].repeat_interleave(2, 0)
    return model, out, multi_turn_metrics(out, rollout.last_stats)


def _sampled(out, row: int) -> torch.Tensor:
    """Row ``row``'s sampled response columns (bool over its real response tokens)."""
    width = out["responses"].shape[1]
    real = out["attention_mask"][row, -width:].bool()
    return out["response_mask"][row][real].bool()


def _diff(log_probs: torch.Tensor, out) -> float:
    """The largest |log_probs - rollout log-probs| over the sampled response tokens."""
    mask = out["response_mask"].bool()
    return float((log_probs[mask] - out["rollout_log_probs"][mask]).abs().max())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_an_episode_whose_tool_shows_images_trains_on_the_rollouts_tokens_and_log_probs(
    model_dirs, family, pack_on_cpu
):
    model_dir = model_dirs[family]
    model, out, metrics = _episodes(model_dir)
    image_token = model.config.image_token_id
    # the tool ran and showed its images: each placeholder run is one 56 x 56 view
    assert metrics["tool/look/calls"] >= 3 and metrics["tool/look/errors"] == 0
    assert metrics["multi_turn/num_turns/max"] >= 4  # a second observation in one episode
    rows = out.non_tensors["multi_modal_inputs"]
    shown = [i for i, images in enumerate(rows) if RESPONSE_IMAGES in images]
    assert len(shown) >= 3
    per_view = (SIDE // 28) ** 2
    for i in shown:
        columns = rows[i][RESPONSE_IMAGES]
        views = len(columns) // per_view
        assert views >= 1 and len(columns) == views * per_view
        assert set(rows[i]) == {*IMAGE_INPUTS, RESPONSE_IMAGES}
        assert (out["responses"][i][columns] == image_token).all()
        assert not out["response_mask"][i][columns].any()  # appended: never trained on
    # the trained tokens are the episode's own record, turn by turn
    checked, first = token_check(out)
    assert checked["rollout/token_mismatch"] == 0 and first is None, first
    assert checked["multi_turn/tool_tokens"] > 0 and checked["multi_turn/loss_on_tool_tokens"] == 0
    # the rollout's log-probs are transformers' own on the whole episode (all its images)
    for row in range(len(out)):
        reference = reference_episode_log_probs(model, out, row, image_token)
        sampled = _sampled(out, row)
        width = out["responses"].shape[1]
        rollout = out["rollout_log_probs"][row][out["attention_mask"][row, -width:].bool()]
        assert torch.allclose(reference[sampled], rollout[sampled], atol=1e-5), row
    # the actor's forward, padded and packed, gives the rollout's log-probs
    for packed in (False, True):
        engine = TrainEngine(
            model_dir, device="cpu", mixed_precision=False, use_remove_padding=packed
        )
        log_probs = engine.forward(out, micro_batch_size=3)["log_probs"]
        assert _diff(log_probs, out) <= TOLERANCE, packed
    # without the observations' images (fed as plain tokens), they are not the rollout's
    dropped = out.select(*out.keys())
    column = np.empty(len(out), dtype=object)
    for i, images in enumerate(out.non_tensors["multi_modal_inputs"]):
        column[i] = _prompt_images_only(images, out, i, image_token)
    dropped.non_tensors["multi_modal_inputs"] = column
    log_probs = engine.forward(dropped, micro_batch_size=3)["log_probs"]
    assert _diff(log_probs, out) > 10 * TOLERANCE


def _prompt_images_only(images: dict, out, row: int, image_token: int) -> dict:
    """A row's images without its observations' (the prompt's are the first ones)."""
    if RESPONSE_IMAGES not in images:
        return images
    width = out["responses"].shape[1]
    prompt = out["input_ids"][row, :-width]
    count = int(((prompt == image_token) & out["attention_mask"][row, :-width].bool()).sum())
    grids, kept, patches = images["image_grid_thw"], [], 0
    for grid in grids:
        if count <= 0:
            break
        kept.append(grid)
        patches += int(grid.prod())
        count -= int(grid.prod()) // 4
    if not kept:
        return {}
    return {"pixel_values": images["pixel_values"][:patches], "image_grid_thw": torch.stack(kept)}


class _VerlResponse:
    """verl's ``ToolResponse`` as a tool returns it: ``text`` and ``image``."""

    def __init__(self, text, image):
        self.text, self.image = text, image


def test_a_tools_images_become_the_observations_image_parts(model_dirs):
    from PIL import Image

    from rayrl.envs import build_tools
    from rayrl.envs.tool import ToolResult, as_result, not_text, observation_content
    from rayrl.rollout.agent.format import TurnFormat, TurnFormatError

    red = Image.new("RGB", (28, 28), (255, 0, 0))
    ours = as_result((ToolResult("seen", images=[red]), 1.0))
    assert ours.images == [red] and ours.reward == 1.0
    verl = _VerlResponse("seen", [red, red])
    assert as_result(verl).images == [red, red] and not_text(verl) is None
    assert observation_content(as_result("plain")) == "plain"
    parts = observation_content(ours)
    assert parts == [{"type": "image", "image": red}, {"type": "text", "text": "seen"}]
    # the look tool crops its image, 56 x 56
    (look,) = build_tools(["look"])
    view = look.execute({"region": "top"}, look.create({"image": png(64, 96, 1)}))
    assert view.images[0].size == (SIDE, SIDE) and view.text == "the top of the image"
    # a vision-language model's format expands the placeholder; a text-only one refuses
    model_dir = model_dirs["qwen2_5_vl"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = load_vision_processor(model_dir, tokenizer, backend="pil")
    message = [{"role": "tool", "content": observation_content(view)}]
    shown = TurnFormat(tokenizer, vision=vision).observation(message, None)
    assert shown.images is not None and len(shown.images.offsets) == (SIDE // 28) ** 2
    assert all(shown.tokens[o] == vision.image_token_id for o in shown.images.offsets)
    assert shown.messages[0]["content"][0] == {"type": "image"}  # no pixels in the trajectory
    with pytest.raises(TurnFormatError, match="no image processor"):
        TurnFormat(tokenizer).observation(message, None)

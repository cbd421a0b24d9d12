"""The training engine on a vision-language model (issue 48): the actor's log-probs of
sampled responses are transformers' own forward with each row's pixel_values and
image_grid_thw (fp32, 1e-5), padded, packed and in token-budget micro-batches, and
another image gives other log-probs; a sampled image token in a response is fed as the
token generation fed; a frozen vision tower has no gradients and no optimizer state;
LoRA adapters train beside the images, the reference is the base model; a Qwen2-VL
runs alike."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2_5_VLForConditionalGeneration

from rayrl.train.engine import TrainEngine
from vision_cases import (
    mixed_rows,
    png,
    prompts,
    qwen2_vl_model,
    reference_log_probs,
    row,
    samples,
    sharp_vision_model,
)

WIDTH = 6
LENGTHS = [6, 4, 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_vision_model(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def model(model_dir):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def batch(model_dir, model):
    _, prompt_batch = prompts(model_dir, mixed_rows())
    responses = torch.randint(0, 500, (3, WIDTH), generator=torch.Generator().manual_seed(0))
    assert not (responses == model.config.image_token_id).any()
    return samples(prompt_batch, responses, LENGTHS)


def _engine(model_dir, **kwargs) -> TrainEngine:
    return TrainEngine(model_dir, device="cpu", mixed_precision=False, **kwargs)


def _matches(log_probs: torch.Tensor, model, batch) -> bool:
    """Whether every row's response log-probs are transformers' own (1e-5)."""
    image_token = model.config.image_token_id
    return all(
        torch.allclose(
            log_probs[i, :n], reference_log_probs(model, batch, i, image_token)[:n], atol=1e-5
        )
        for i, n in enumerate(LENGTHS)
    )


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_log_probs_are_transformers_own_with_the_rows_images(
    model_dir, model, batch, packed, pack_on_cpu
):
    engine = _engine(model_dir, use_remove_padding=packed)
    assert engine.load_report.source == "checkpoint"  # its saved names read as the model's
    for sizes in ({"micro_batch_size": 2}, {"max_tokens_per_micro_batch": 64}):
        out = engine.forward(batch, **sizes)["log_probs"]
        assert _matches(out, model, batch), sizes


def test_another_image_gives_other_log_probs(model_dir, model, batch):
    _, other = prompts(
        model_dir, [row("what <image> is", [png(100, 150, seed=7)]), *mixed_rows()[1:]]
    )
    swapped = samples(other, batch["responses"], LENGTHS)
    assert torch.equal(swapped["input_ids"], batch["input_ids"])
    out = _engine(model_dir).forward(swapped, micro_batch_size=3)["log_probs"]
    assert not _matches(out, model, batch)  # the check fails on a changed image
    assert _matches(out, model, swapped)


def test_a_sampled_image_token_in_a_response_is_fed_as_a_token(model_dir, model, batch):
    responses = batch["responses"].clone()
    responses[0, 2] = model.config.image_token_id
    _, prompt_batch = prompts(model_dir, mixed_rows())
    sampled = samples(prompt_batch, responses, LENGTHS)
    out = _engine(model_dir).forward(sampled, micro_batch_size=3)["log_probs"][0]
    # generation's view: the prompt prefilled with its image, then each token fed alone
    mask = sampled["attention_mask"][0].bool()
    ids = sampled["input_ids"][0][mask][None]
    prompt = ids.shape[1] - LENGTHS[0]
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    kinds = (ids[:, :prompt] == model.config.image_token_id).int()
    images = prompt_batch.non_tensors["multi_modal_inputs"][0]
    with torch.no_grad():
        logits = [
            model(
                input_ids=ids[:, :prompt],
                mm_token_type_ids=kinds,
                past_key_values=cache,
                use_cache=True,
                **images,
            ).logits[0, -1]
        ]
        delta = model.model.rope_deltas
        for column in range(prompt, ids.shape[1] - 1):
            position = (torch.tensor([[column]]) + delta).view(1, 1, 1).expand(3, 1, 1)
            step = model(
                input_ids=ids[:, column : column + 1],
                past_key_values=cache,
                position_ids=position,
                use_cache=True,
            )
            logits.append(step.logits[0, -1])
    expected = torch.log_softmax(torch.stack(logits).float(), -1).gather(-1, ids[0, prompt:, None])
    assert torch.allclose(out[: LENGTHS[0]], expected[:, 0], atol=1e-5)


def _loss(outputs: dict, micro) -> tuple[torch.Tensor, dict]:
    return -(outputs["log_probs"] * micro["response_mask"]).sum() / 16, {}


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_frozen_vision_tower_gets_no_gradients_and_no_optimizer_state(model_dir, batch, frozen):
    engine = _engine(model_dir, optim={"lr": 1e-2}, freeze_vision_tower=frozen)
    tower = list(engine.model.model.visual.parameters())
    before = [p.detach().clone() for p in tower]
    text_before = engine.model.lm_head.weight.detach().clone()
    engine.train_step(batch, _loss, micro_batch_size=2)
    tower_moved = any(not torch.equal(a, b) for a, b in zip(before, tower, strict=True))
    assert tower_moved != frozen
    assert not torch.equal(text_before, engine.model.lm_head.weight)  # the language model learns
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert bool(optimized & {id(p) for p in tower}) != frozen
    assert all(p.requires_grad != frozen for p in tower)
    if frozen:
        assert all(id(p) not in engine.optimizer.state for p in tower)


def test_freezing_the_vision_tower_of_a_text_model_is_refused(tmp_path):
    from rayrl.models.tiny import build_tiny_model

    text = build_tiny_model(tmp_path / "text", layers=1, seed=0)
    with pytest.raises(ValueError, match="text-only model.*freeze_vision_tower=false"):
        _engine(text, freeze_vision_tower=True)


def test_lora_adapters_train_with_the_images_and_the_reference_is_the_base(model_dir, model, batch):
    from rayrl.train.lora import LoraSpec

    engine = _engine(model_dir, optim={"lr": 1e-2}, lora=LoraSpec(8), freeze_vision_tower=True)
    assert _matches(engine.forward(batch, micro_batch_size=3)["log_probs"], model, batch)
    tower = {id(p) for p in engine.model.base_model.model.model.visual.parameters()}
    trained = [p for p in engine.model.parameters() if p.requires_grad]
    assert trained and not tower & {id(p) for p in trained}  # frozen: adapters there too
    engine.train_step(batch, _loss, micro_batch_size=3)
    assert not _matches(engine.forward(batch, micro_batch_size=3)["log_probs"], model, batch)
    with engine.adapters_disabled():
        assert _matches(engine.forward(batch, micro_batch_size=3)["log_probs"], model, batch)
    merged = engine.full_state_dict()
    assert set(merged) == set(model.state_dict())  # the base model's names


def test_a_qwen2_vl_trains_and_rolls_out_alike(model_dir, tmp_path, pack_on_cpu):
    from transformers import Qwen2VLForConditionalGeneration

    from rayrl.rollout.hf.engine import HFRolloutEngine
    from rayrl.rollout.sampling import SamplingParams

    qwen2 = qwen2_vl_model(tmp_path, model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen2).eval()
    _, prompt_batch = prompts(qwen2, mixed_rows())
    responses = torch.randint(0, 500, (3, WIDTH), generator=torch.Generator().manual_seed(0))
    batch = samples(prompt_batch, responses, LENGTHS)
    for packed in (False, True):
        engine = _engine(qwen2, use_remove_padding=packed)
        assert _matches(engine.forward(batch, micro_batch_size=3)["log_probs"], model, batch)
    sampled = SamplingParams(n=1, temperature=1.0, do_sample=True, max_new_tokens=WIDTH, seed=0)
    out = HFRolloutEngine(model=model).generate(prompt_batch, sampled)
    for i in range(3):
        n = int(out["response_mask"][i].sum())
        expected = reference_log_probs(model, out, i, model.config.image_token_id)[:n]
        assert torch.allclose(out["rollout_log_probs"][i, :n], expected, atol=1e-4)

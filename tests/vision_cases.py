"""Shared pieces of the vision-language tests (issue 48): a tiny Qwen2.5-VL whose outputs
depend on its images, prompt rows with and without images, and batches of sampled
responses in the layout the trainer sends (left-padded prompts, right-padded responses,
each row's `multi_modal_inputs` beside it).

The tiny model of `rayrl.models.tiny_vision` has transformers' initial weights (std
0.02): its next-token distributions are all but uniform and its greedy tokens the same
for any image. `sharp_vision_model` redraws every weight with std 0.2, so that tokens
and log-probs follow the image (a swapped image changes them).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rayrl.batch import Batch
from rayrl.data import PromptDataset
from rayrl.data.vision import load_vision_processor
from rayrl.models.tiny_vision import build_tiny_vision_model

SHARP_STD = 0.2


def sharp_vision_model(root: Path) -> Path:
    """The tiny Qwen2.5-VL with weights redrawn ~ N(0, 0.2) (seed 0), its tokenizer and
    processor config beside them, saved under ``root / "sharp"``."""
    base = build_tiny_vision_model(root / "base")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base)
    return _sharpened(model, base, root / "sharp")


def qwen2_vl_model(root: Path, sharp: Path) -> Path:
    """A tiny Qwen2-VL (its own vision tower: no window attention, a LayerNorm merger)
    with the tokens, tokenizer and processor config of the ``sharp`` Qwen2.5-VL, weights
    ~ N(0, 0.2) (seed 0), saved under ``root / "qwen2-vl"``."""
    from transformers import AutoConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    like = AutoConfig.from_pretrained(sharp)
    text = like.text_config
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": text.num_key_value_heads,
            "rope_parameters": dict(text.rope_parameters),
            **{k: getattr(text, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": text.hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **{
            k: getattr(like, k)
            for k in ("image_token_id", "video_token_id", "vision_start_token_id")
        },
        vision_end_token_id=like.vision_end_token_id,
        tie_word_embeddings=True,
    )
    return _sharpened(Qwen2VLForConditionalGeneration(config), sharp, root / "qwen2-vl")


def _sharpened(model, like: Path, out: Path) -> Path:
    """``model`` with weights redrawn ~ N(0, 0.2) (seed 0), saved at ``out`` with the
    tokenizer and processor config of the model directory ``like``."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * SHARP_STD)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(like).save_pretrained(out)
    shutil.copyfile(like / "preprocessor_config.json", out / "preprocessor_config.json")
    return out


def png(height: int, width: int, seed: int) -> bytes:
    """A random RGB image's PNG bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def row(content: str, images: list[bytes] | None = None) -> dict:
    """A prompt row (verl's columns), its images as {bytes} entries."""
    out = {
        "data_source": "count_squares",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": "3"},
    }
    if images:
        out["images"] = [{"bytes": b} for b in images]
    return out


def mixed_rows(seed: int = 0) -> list[dict]:
    """One image, no image, two images: prompts of three lengths in one batch."""
    return [
        row("what <image> is", [png(100, 150, seed)]),
        row("just some text here please"),
        row("<image> and <image>?", [png(56, 56, seed + 1), png(80, 60, seed + 2)]),
    ]


def prompts(model_dir: Path, rows: list[dict]) -> tuple[PromptDataset, Batch]:
    """The rows read with the model's processor, and their collated, left-padded batch."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = load_vision_processor(model_dir, tokenizer, backend="pil")
    dataset = PromptDataset(rows, tokenizer, max_prompt_length=512, vision=vision)
    batch = dataset.collate(list(range(len(rows))))
    batch.meta["step"] = 0
    return dataset, batch


def samples(prompt_batch: Batch, responses: torch.Tensor, lengths: list[int]) -> Batch:
    """The trainer's layout of sampled responses after ``prompt_batch``: ids, mask and
    positions over prompt + response, the response mask, the rows' images."""
    width = responses.shape[1]
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.cat([prompt_batch["input_ids"], responses], 1)
    mask = torch.cat([prompt_batch["attention_mask"], response_mask], 1)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
        },
        {"multi_modal_inputs": prompt_batch.non_tensors["multi_modal_inputs"]},
    )


def reference_log_probs(model, batch: Batch, row_index: int, image_token_id: int) -> torch.Tensor:
    """Row ``row_index``'s response log-probs from transformers' own forward on its real
    tokens with its pixel_values and image_grid_thw (fp32): the check the engine must meet."""
    mask = batch["attention_mask"][row_index].bool()
    ids = batch["input_ids"][row_index][mask][None]
    prompt = int(batch["attention_mask"][row_index, : -batch["responses"].shape[1]].sum())
    kinds = torch.zeros_like(ids)
    kinds[0, :prompt] = (ids[0, :prompt] == image_token_id).int()
    images = batch.non_tensors["multi_modal_inputs"][row_index]
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=kinds, **images).logits[0].float()
    log_probs = torch.log_softmax(logits, -1)
    return log_probs[prompt - 1 : -1].gather(-1, ids[0, prompt:, None])[:, 0]


def greedy_alone(model, batch: Batch, i: int, new: int) -> list[int]:
    """transformers' greedy generate() of ``new`` tokens on row ``i`` of ``batch`` alone
    (no padding), with its own images."""
    mask = batch["attention_mask"][i].bool()
    ids = batch["input_ids"][i][mask][None]
    kinds = (ids == model.config.image_token_id).int()
    images = batch.non_tensors["multi_modal_inputs"][i]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, mm_token_type_ids=kinds, max_new_tokens=new, do_sample=False, **images
        )
    return out[0, ids.shape[1] :].tolist()

"""Prompts with images (issue 48, the data path): verl's image column and `<image>`
placeholders, each image's tokens counted as the model's processor counts them, bad
images set aside with file, row and reason, and inputs a real Qwen2.5-VL forward takes."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from conftest import subprocess_pythonpath
from rayrl.data import PromptDataset, read_rows_with_sources, write_parquet
from rayrl.data.vision import load_vision_processor, torchvision_imports
from rayrl.models.tiny_vision import IMAGE_PAD, VISION_END, VISION_START, build_tiny_vision_model

SRC = Path(__file__).resolve().parent.parent / "src"
# height x width: small ones grow to min_pixels, large ones shrink to max_pixels
SIZES = [(100, 150), (40, 300), (28, 28), (13, 17), (500, 700), (1000, 30)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_vision_model(tmp_path_factory.mktemp("vl") / "tiny-vl")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def vision(model_dir, tokenizer):
    return load_vision_processor(model_dir, tokenizer, backend="pil")


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _png(height: int, width: int, seed: int = 0) -> bytes:
    out = io.BytesIO()
    _image(height, width, seed).save(out, "PNG")
    return out.getvalue()


def _row(content: str, images: list | None = None, **extra) -> dict:
    row = {
        "data_source": "vqa",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": "7"},
        **extra,
    }
    if images is not None:
        row["images"] = images
    return row


def _reference(model_dir, tokenizer, monkeypatch):
    """transformers' own Qwen2.5-VL processor. Without torchvision, transformers 5.17
    refuses to build it only because its video processor class needs torchvision: the
    class check is lifted and the processor runs, for real, on the PIL image processor."""
    from transformers import AutoProcessor, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    if torchvision_imports():
        return AutoProcessor.from_pretrained(model_dir)
    monkeypatch.setattr(
        ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)
    )
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
        tokenizer=tokenizer,
        video_processor=None,
    )


@pytest.mark.parametrize(
    "bounds",
    [
        {},
        {"min_pixels": 28 * 28, "max_pixels": 16 * 28 * 28},
        {"min_pixels": 8 * 28 * 28, "max_pixels": 100 * 28 * 28},
    ],
    ids=["processor", "smaller", "larger"],
)
def test_each_image_expands_to_the_processors_token_count(
    model_dir, tokenizer, bounds, monkeypatch
):
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    mine = load_vision_processor(model_dir, tokenizer, mm_processor_kwargs=bounds, backend="pil")
    ref = _reference(model_dir, tokenizer, monkeypatch)
    text = "Compare " + " and ".join(f"{VISION_START}{IMAGE_PAD}{VISION_END}" for _ in images)
    expected = ref(text=[text], images=images, return_tensors="pt", **mine.options)

    ids = mine.encode(text, images)  # at load: counted from the sizes, no pixels made
    batch_ids, inputs = mine.inputs(text, images)  # in a batch: from the pixels
    assert ids == batch_ids == expected["input_ids"][0].tolist()
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    counts = (expected["image_grid_thw"].prod(-1) // 4).tolist()
    assert mine.image_tokens(ids) == sum(counts)
    assert len(set(counts)) > 2  # the sizes and bounds give different counts
    if not torchvision_imports():  # the same PIL image processor: the same pixels
        assert torch.equal(inputs["pixel_values"], expected["pixel_values"])


def test_a_processor_config_as_qwen25_vl_ships_it_sets_the_bounds(model_dir, tokenizer, tmp_path):
    import json
    import shutil

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    defaults = dict(Qwen2VLImageProcessorPil.size)
    shipped = tmp_path / "shipped"
    shutil.copytree(model_dir, shipped)
    config = json.loads((shipped / "preprocessor_config.json").read_text())
    del config["size"]  # top-level min_pixels / max_pixels only
    config.update(min_pixels=1000, max_pixels=20000)
    (shipped / "preprocessor_config.json").write_text(json.dumps(config))
    loaded = load_vision_processor(shipped, tokenizer, backend="pil")
    assert (loaded.min_pixels, loaded.max_pixels) == (1000, 20000)
    assert dict(Qwen2VLImageProcessorPil.size) == defaults  # the class's defaults untouched
    kwargs = load_vision_processor(
        shipped, tokenizer, mm_processor_kwargs={"max_pixels": 9000}, backend="pil"
    )
    assert (kwargs.min_pixels, kwargs.max_pixels) == (1000, 9000)  # verl's key wins


def test_what_a_vision_processor_cannot_be_made_from_is_named(model_dir, tmp_path):
    from rayrl.data import DataError
    from rayrl.models.tokenizer import train_tokenizer

    text_tokenizer = train_tokenizer()  # the tiny text models' own: no vision tokens
    with pytest.raises(DataError, match=r"the tokenizer has no image token <\|image_pad\|>"):
        load_vision_processor(model_dir, text_tokenizer, backend="pil")
    with pytest.raises(DataError, match="has no preprocessor_config.json, so no image processor"):
        load_vision_processor(tmp_path, text_tokenizer)
    with pytest.raises(DataError, match="min_pixels=9000 is over max_pixels=5000"):
        load_vision_processor(
            model_dir,
            AutoTokenizer.from_pretrained(model_dir),
            mm_processor_kwargs={"min_pixels": 9000, "max_pixels": 5000},
            backend="pil",
        )


def test_ids_are_the_chat_template_with_each_placeholder_expanded(tokenizer, vision):
    image = _image(100, 150)
    rows = [_row("Count the dots in <image> please.", [image]), _row("What is 3+4?")]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=256, vision=vision)
    plain = PromptDataset([rows[1]], tokenizer, max_prompt_length=256)

    grid = vision.image_processor([image], return_tensors="pt", **vision.options)["image_grid_thw"]
    tokens = int(grid.prod()) // 4
    text = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": f"Count the dots in {VISION_START}{IMAGE_PAD}{VISION_END} please.",
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    at = rendered.index(pad)
    assert ds.prompt_ids[0] == rendered[:at] + [pad] * tokens + rendered[at + 1 :]
    assert ds.prompt_ids[1] == plain.prompt_ids[0]  # text rows read as before

    batch = ds.collate([0, 1])
    inputs = batch.non_tensors["multi_modal_inputs"]
    assert inputs[0]["image_grid_thw"].tolist() == grid.tolist()
    assert inputs[0]["pixel_values"].shape[0] == int(grid.prod())
    assert inputs[1] == {}
    assert batch.non_tensors["raw_prompt"][0] == rows[0]["prompt"]  # as the row has it


def test_the_models_own_processor_and_the_pil_path_give_the_same_rows(
    model_dir, tokenizer, vision, monkeypatch
):
    from rayrl.data.vision import FullProcessor

    full = FullProcessor(_reference(model_dir, tokenizer, monkeypatch), tokenizer, {})
    assert full.options == vision.options and full.image_token_id == vision.image_token_id
    rows = [
        _row("<image> is wider than <image>?", [_png(60, 200, 1), _png(200, 60, 2)]),
        _row("Describe <image>.", [{"bytes": _png(500, 500, 3), "max_pixels": 16 * 28 * 28}]),
        _row("No picture here."),
    ]
    by_pil = PromptDataset(rows, tokenizer, max_prompt_length=256, vision=vision)
    by_full = PromptDataset(rows, tokenizer, max_prompt_length=256, vision=full)
    assert by_full.prompt_ids == by_pil.prompt_ids and by_full.rejected == []
    pil_inputs = by_pil.collate([0, 1, 2]).non_tensors["multi_modal_inputs"]
    full_inputs = by_full.collate([0, 1, 2]).non_tensors["multi_modal_inputs"]
    assert pil_inputs[2] == full_inputs[2] == {}
    for mine, theirs in zip(pil_inputs[:2], full_inputs[:2], strict=True):
        assert mine.keys() == theirs.keys() == {"pixel_values", "image_grid_thw"}
        assert torch.equal(mine["image_grid_thw"], theirs["image_grid_thw"])
        if not torchvision_imports():  # the same PIL image processor: the same pixels
            assert torch.equal(mine["pixel_values"], theirs["pixel_values"])


def test_each_rows_inputs_travel_with_it_through_batch_operations(tokenizer, vision):
    import pickle

    from rayrl.batch import Batch

    rows = [_row("<image>", [_png(56, 56 * k, k)]) for k in (1, 2, 3)] + [_row("Text only.")]
    batch = PromptDataset(rows, tokenizer, max_prompt_length=256, vision=vision).collate(range(4))
    grids = [
        r["image_grid_thw"].tolist() if r else None for r in batch.non_tensors["multi_modal_inputs"]
    ]
    assert grids == [[[1, 4, 4]], [[1, 4, 8]], [[1, 4, 12]], None]

    def grids_of(b: Batch) -> list:
        return [
            r["image_grid_thw"][0, 2].item() if r else 0
            for r in b.non_tensors["multi_modal_inputs"]
        ]

    assert grids_of(batch.repeat(2)) == [4, 4, 8, 8, 12, 12, 0, 0]  # n samples of a prompt
    assert grids_of(batch.index([3, 0])) == [0, 4]
    halves = batch.chunk(2)
    assert grids_of(Batch.concat([halves[1], halves[0]])) == [12, 0, 4, 8]
    back = pickle.loads(pickle.dumps(batch))  # as through Ray's object store
    for mine, theirs in zip(
        batch.non_tensors["multi_modal_inputs"], back.non_tensors["multi_modal_inputs"], strict=True
    ):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_images_as_bytes_paths_and_dicts_read_alike(tokenizer, vision, tmp_path):
    folder = tmp_path / "data"
    (folder / "imgs").mkdir(parents=True)
    pngs = [_png(90, 120, 1), _png(300, 60, 2)]
    for k, data in enumerate(pngs):
        (folder / "imgs" / f"{k}.png").write_bytes(data)
    both = "First <image>, then <image>: which is taller?"
    data_uri = "data:image/png;base64," + base64.b64encode(pngs[1]).decode()
    files = {
        "bytes": [_row(both, pngs)],
        "paths": [  # relative to the data file, absolute, file://, data: URI
            _row(both, ["imgs/0.png", str(folder / "imgs" / "1.png")]),
            _row(both, [f"file://{folder / 'imgs' / '0.png'}", data_uri]),
        ],
        "hf": [
            _row(both, [{"bytes": pngs[0], "path": None}, {"bytes": None, "path": "imgs/1.png"}])
        ],
        "verl": [_row(both, [{"image": "imgs/0.png"}, {"image": str(folder / "imgs" / "1.png")}])],
    }
    paths = [write_parquet(rows, folder / f"{name}.parquet") for name, rows in files.items()]
    rows, sources = read_rows_with_sources(paths)
    ds = PromptDataset(rows, tokenizer, max_prompt_length=512, sources=sources, vision=vision)

    assert ds.rejected == [] and len(ds) == 5
    assert all(ids == ds.prompt_ids[0] for ids in ds.prompt_ids)
    inputs = ds.collate(range(5)).non_tensors["multi_modal_inputs"]
    for row in inputs[1:]:
        assert torch.equal(row["pixel_values"], inputs[0]["pixel_values"])
        assert torch.equal(row["image_grid_thw"], inputs[0]["image_grid_thw"])


def test_an_images_own_max_pixels_resizes_it_first(tokenizer, vision):
    png = _png(300, 400)
    ds = PromptDataset(
        [
            _row("<image>", [{"bytes": png}]),
            _row("<image>", [{"bytes": png, "max_pixels": 8 * 28 * 28}]),
        ],
        tokenizer,
        max_prompt_length=512,
        vision=vision,
    )
    whole, bounded = (vision.image_tokens(ids) for ids in ds.prompt_ids)
    assert (whole, bounded) == (54, 6)  # at most 50176 px: 6x9 merged patches; 6272: 2x3
    grid = ds.collate([1]).non_tensors["multi_modal_inputs"][0]["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]


def test_bad_images_are_set_aside_with_file_row_and_reason(tokenizer, vision, tmp_path):
    good, junk = _png(64, 64), b"not an image at all"
    rows = [
        _row("Look: <image>", [good]),
        _row("Look: <image>", [junk]),
        _row("Look: <image>", [good[: len(good) // 2]]),
        _row("Look: <image>", ["imgs/missing.png"]),
        _row("Look: <image>", [{"caption": "a cat"}]),
        _row("Look: <image> <image>", [good]),
        _row("Look: <video>", [], videos=["clip.mp4"]),
        _row("Look: <image>", ["https://example.com/cat.png"]),
    ]
    first = write_parquet(rows[:3], tmp_path / "a.parquet")
    second = write_parquet(rows[3:4], tmp_path / "b.parquet")
    read, sources = read_rows_with_sources([first, second])
    ds = PromptDataset(read, tokenizer, max_prompt_length=512, sources=sources, vision=vision)
    found = [str(r) for r in ds.rejected]
    assert found[0] == (
        f"{first} row 1: image 0 in column 'images' is not in an image format Pillow can "
        f"decode ({len(junk)} bytes)"
    )
    assert found[1].startswith(f"{first} row 2: image 0 in column 'images' failed to decode (")
    assert found[2] == (
        f"{second} row 0: image 0 in column 'images' names file "
        f"{tmp_path / 'imgs' / 'missing.png'}, which does not exist"
    )
    assert len(ds) == 1

    ds = PromptDataset(rows[4:], tokenizer, max_prompt_length=512, vision=vision)
    assert [r.reason for r in ds.rejected] == [
        "image 0 in column 'images' is a dict with no image in it (keys: caption); give "
        "'bytes', 'path' or 'image'",
        "the row has 1 image(s) in column 'images' but 2 <image> placeholder(s) in 'prompt'; "
        "put one <image> in the messages' text where each image goes",
        "the row has 1 video(s) in column 'videos', and rayrl reads no videos yet (images "
        "only); set the row's videos aside or drop them",
        "image 0 in column 'images' is a URL (https://example.com/cat.png); rayrl reads "
        "images from bytes or local files only: download the images and give their paths",
    ]
    text_only = PromptDataset(rows[:1], tokenizer, max_prompt_length=512)
    assert text_only.rejected[0].reason.startswith(
        "the row has 1 image(s) in column 'images', but the prompts are read without an "
        "image processor (a text-only model)"
    )


def test_the_length_filter_counts_image_tokens(tokenizer, vision):
    question = "How many red squares are there in <image>?"
    rows = [
        _row(question, [_png(28, 28)]),  # grows to 56 x 56: 4 image tokens
        _row(question, [_png(300, 600)]),  # shrinks to 140 x 308: 55 image tokens
        _row(question.replace("<image>", "the picture")),
    ]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=64, vision=vision, filter_overlong=True)
    text_len = len(ds.prompt_ids[0]) - 4
    assert vision.image_tokens(ds.prompt_ids[0]) == 4 and len(ds) == 2
    assert text_len + 4 <= 64 < text_len + 55  # only its image's tokens make row 1 too long
    assert [str(r) for r in ds.rejected] == [
        f"row 1: prompt of {text_len + 55} tokens (55 of them for its images) is over "
        "data.max_prompt_length=64"
    ]
    cut = PromptDataset(rows, tokenizer, max_prompt_length=64, vision=vision, truncation="left")
    assert cut.rejected[0].reason.endswith(
        "a prompt with images is not cut (its image tokens must stay whole)"
    )
    from rayrl.data import DataError

    with pytest.raises(DataError, match=r"row 1: prompt .* lower the images' max_pixels"):
        PromptDataset(rows, tokenizer, max_prompt_length=64, vision=vision, filter_overlong=False)


def test_a_tiny_qwen25_vl_forward_takes_the_rows_inputs(model_dir, tokenizer, vision):
    from transformers import Qwen2_5_VLForConditionalGeneration

    rows = [
        _row("<image> vs <image>", [_png(100, 150), _png(40, 300)]),
        _row("<image>", [_png(56, 90)]),
    ]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=512, vision=vision)
    inputs = ds.collate([0, 1]).non_tensors["multi_modal_inputs"]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    pad = vision.image_token_id
    with torch.no_grad():
        for ids, row in zip(ds.prompt_ids, inputs, strict=True):
            ids = torch.tensor([ids])
            out = model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), **row)
            assert out.logits.shape[:2] == ids.shape
            assert torch.isfinite(out.logits).all()
        ids = ds.prompt_ids[1]
        short = torch.tensor([ids[: ids.index(pad)] + ids[ids.index(pad) + 1 :]])  # one pad fewer
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            model(input_ids=short, mm_token_type_ids=(short == pad).int(), **inputs[1])


def test_without_pillow_images_fail_with_the_extra_to_install(model_dir):
    script = (
        "import sys\n"
        "class NoPillow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'PIL':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoPillow())\n"
        "from pathlib import Path\n"
        "from transformers import AutoTokenizer\n"
        "from rayrl.data.images import open_image\n"
        "from rayrl.data.vision import load_vision_processor\n"
        f"path = {str(model_dir)!r}\n"
        "for call in (lambda: load_vision_processor(path, AutoTokenizer.from_pretrained(path)),\n"
        "             lambda: open_image(b'png', Path('.'))):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as err:\n"
        "        print(err)\n"
    )
    env = {"PYTHONPATH": subprocess_pythonpath(SRC), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    line = "reading images needs Pillow, which is not installed: pip install 'rayrl[vision]'"
    assert done.stdout.splitlines() == [line, line]

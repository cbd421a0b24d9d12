"""Tiny Qwen2 models and their tokenizer: offline loading, generation, determinism, CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rayrl.models import (
    TinySpec,
    build_tiny_model,
    count_parameters,
    reference_05b,
    train_tokenizer,
)
from rayrl.models.tokenizer import SPECIAL_TOKENS, default_corpus

SMALL = dict(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
MATH = [
    "12+7=19",
    "Natalia sold 48 clips in April and 24 in May; 48 + 24 = 72.\n#### 72",
    "Using the numbers [3, 5, 7], create an equation that equals 1. <answer>3 + 5 - 7</answer>",
    "  (99 * 3) / 11 = 27\t-0.5e+3 != 42 ",
]


def _hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **SMALL)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    """(model, tokenizer) loaded by the Auto classes with the Hub switched off."""
    import huggingface_hub.constants as hub
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hub, "HF_HUB_OFFLINE", True)
        model = AutoModelForCausalLM.from_pretrained(tiny_dir)
        tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    return model, tokenizer


def test_directory_loads_offline_with_expected_config(tiny_dir, loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(_hashes(tiny_dir))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (1, 32, 4)
    assert (cfg.num_key_value_heads, cfg.intermediate_size) == (2, 64) and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tokenizer) == 512
    eot, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == cfg.eos_token_id == eot
    assert cfg.pad_token_id == cfg.bos_token_id == eot
    gen = model.generation_config
    assert gen.eos_token_id == [im_end, eot] and gen.pad_token_id == eot
    assert tokenizer.model_max_length == cfg.max_position_embeddings == 2048
    counts = count_parameters(tiny_dir)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == 512 * 32


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_produces_new_tokens(loaded, sample):
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=6, do_sample=sample, temperature=1.0)
    n = prompt["input_ids"].shape[1]
    assert out.shape[1] > n
    assert torch.equal(out[0, :n], prompt["input_ids"][0])
    assert int(out[0, n:].max()) < model.config.vocab_size


def test_chat_template_renders_chatml(loaded):
    _, tokenizer = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain.endswith("<|im_end|>\n") and "assistant" not in plain
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


def test_same_seed_identical_files_different_seed_different_weights(tmp_path, tiny_dir):
    again = build_tiny_model(tmp_path / "again", seed=0, **SMALL)
    other = build_tiny_model(tmp_path / "other", seed=1, **SMALL)
    assert _hashes(again) == _hashes(tiny_dir)
    differ = {k for k, v in _hashes(other).items() if _hashes(tiny_dir)[k] != v}
    assert differ == {"model.safetensors"}  # the tokenizer is shared across seeds


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=5, **SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_round_trips_math_and_splits_digits():
    tok = train_tokenizer()
    for text in [*MATH, *default_corpus(seed=3, lines=40)]:
        assert tok.decode(tok.encode(text)) == text
    pieces = tok.convert_ids_to_tokens(tok.encode("#### 1234"))
    assert pieces[-4:] == ["1", "2", "3", "4"]
    sentence = "The answer is the total number of apples."
    assert len(tok.encode(sentence)) < len(sentence) / 3  # common words are merged
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.bos_token is None and tok.unk_token is None


def test_tokenizer_is_deterministic_and_follows_its_inputs():
    a, b = train_tokenizer(seed=0), train_tokenizer(seed=0)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.backend_tokenizer.to_str() != train_tokenizer(seed=1).backend_tokenizer.to_str()
    custom = train_tokenizer(corpus=["abab cdcd"] * 20, alphabet="αβ+", vocab_size=300)
    assert len(custom) < 300 and custom.backend_tokenizer.to_str() != a.backend_tokenizer.to_str()
    assert len(custom.encode("αβ")) == 2 and custom.decode(custom.encode("αβ+ab")) == "αβ+ab"
    with pytest.raises(ValueError, match="at least 259"):
        train_tokenizer(vocab_size=100)


def test_saved_tokenizer_matches_the_trained_one(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(alphabet="αβ")
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "Tom has 12 αβ apples.\n#### 12 <|im_end|>"
    assert back.encode(text) == tok.encode(text) and len(back) == len(tok)


def test_untied_bfloat16_build(tmp_path):
    from safetensors import safe_open

    path = TinySpec(**SMALL, tie_embeddings=False, dtype="bfloat16").build(tmp_path / "m")
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False


def test_reference_spec_builds_config_only():
    spec = reference_05b()
    cfg = spec.to_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (896, 24, 14)
    assert (cfg.num_key_value_heads, cfg.intermediate_size) == (2, 4864)
    assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings
    assert reference_05b(layers=2).layers == 2


def test_spec_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        TinySpec(heads=4, kv_heads=3).validate()
    with pytest.raises(ValueError, match="hidden=30 must be a multiple of heads=4"):
        TinySpec(hidden=30).validate()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_model(tmp_path / "taken", **SMALL)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"
    built = TinySpec(**SMALL).build(tmp_path / "taken", overwrite=True)
    assert not (built / "notes.txt").exists() and (built / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging left behind


@pytest.fixture
def cli(monkeypatch):
    """`rayrl.cli.main.main` with only this module's command registered."""
    from rayrl.cli import main as cli_main

    monkeypatch.setattr(cli_main, "COMMANDS", ["models_cmd"])
    return cli_main.main


def test_cli_models_tiny(cli, tmp_path, capsys):
    out = tmp_path / "cli-model"
    args = ["models", "tiny", "--out", str(out), "--layers", "1", "--hidden", "32"]
    args += ["--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--seed", "3"]
    assert cli(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(out)
    assert lines[1].startswith(f"parameters: {count_parameters(out)['total']:,}")
    assert "1 layers, hidden 32, 4 heads (2 kv), intermediate 64, vocab 512" in lines[2]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert cli(args) == 2  # refuses to overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["models", "tiny", "--out", str(tmp_path / "x"), "--preset", "nope"]) == 2
    assert "qwen2.5-0.5b" in capsys.readouterr().err
    assert cli(["models"]) == 2 and "tiny" in capsys.readouterr().out

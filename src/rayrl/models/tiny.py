"""Tiny models with random weights (Qwen2 by default; any family of `tiny_families`),
built locally, for tests, demos and benchmarks.

`build_tiny_model` writes a Hugging Face model directory (config, safetensors weights,
generation config, and a tokenizer from `train_tokenizer`) that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load offline.
Weights are drawn from a generator seeded with `seed`, so one seed always gives
byte-identical files. `TinySpec` names a shape; `reference_05b()` is the
Qwen2.5-0.5B shape used for GPU figures (see docs of `reference_05b`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rayrl.models.tiny_families import FAMILIES, NORM_ZERO, family_config
from rayrl.models.tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS, train_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INIT_STD = 0.02
ROPE_THETA = 1_000_000.0
# Every tiny model shares one tokenizer whatever its weight seed: an actor, its
# reference, a critic and a reward model built with different seeds must agree on ids.
TOKENIZER_SEED = 0


@dataclass(frozen=True)
class TinySpec:
    """The shape and seed of a tiny model; the fields of `build_tiny_model`.

    `family` is the transformers ``model_type`` (`tiny_families.FAMILIES`; default qwen2),
    whose own config class builds the model with that family's defaults.

    `vocab_size` is the tokenizer's target size; the model's vocabulary is
    `max(vocab_size, len(tokenizer) rounded up to a multiple of 8)`. `corpus` and
    `alphabet` go to `train_tokenizer` (None: its built-in math corpus).
    """

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab_size: int = 512
    max_position: int = 2048
    seed: int = 0
    corpus: tuple[str, ...] | None = None
    alphabet: str | None = None
    tie_embeddings: bool = True
    dtype: str = "float32"
    family: str = "qwen2"

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot make the model."""
        if self.family not in FAMILIES:
            raise ValueError(
                f"TinySpec.family={self.family!r} is not one of {sorted(FAMILIES)}; pick one."
            )
        positive = ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_position")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TinySpec.{name}={getattr(self, name)} must be at least 1.")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"TinySpec: hidden={self.hidden} must be a multiple of heads={self.heads} "
                f"with an even head size (rotary embeddings); e.g. hidden={self.heads * 16}."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"TinySpec: heads={self.heads} must be a multiple of kv_heads={self.kv_heads} "
                "(grouped-query attention); e.g. kv_heads=1."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"TinySpec.dtype={self.dtype!r} is not one of {sorted(DTYPES)}.")

    def to_config(self, tokenizer: PreTrainedTokenizerBase | None = None) -> PretrainedConfig:
        """The config of this shape (`Qwen2Config`, or the family's); no weights, no
        tokenizer training.

        With `tokenizer`, the vocabulary covers it and the special-token ids are read from
        it. Without, the vocabulary is `vocab_size` and the ids are those
        `train_tokenizer` always assigns (`<|endoftext|>` 0, `<|im_end|>` 2).
        """
        self.validate()
        vocab, eos = self.vocab_size, SPECIAL_TOKENS.index(ENDOFTEXT)
        if tokenizer is not None:
            vocab = max(vocab, round_up(len(tokenizer), 8))
            eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        if self.family != "qwen2":
            return self._family_config(vocab, eos)
        return Qwen2Config(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_position,
            initializer_range=INIT_STD,
            rms_norm_eps=1e-6,
            tie_word_embeddings=self.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            use_sliding_window=False,
            max_window_layers=self.layers,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
            dtype=self.dtype,
            architectures=["Qwen2ForCausalLM"],
        )

    def _family_config(self, vocab: int, eos: int) -> PretrainedConfig:
        shape = dict(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_position,
            initializer_range=INIT_STD,
            rms_norm_eps=1e-6,
            tie_word_embeddings=self.tie_embeddings,
            dtype=self.dtype,
        )
        ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
        return family_config(self.family, shape, ids)

    def build(self, out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write this model to `out_dir`; see `build_tiny_model`."""
        return _write(self, Path(out_dir).absolute(), overwrite)


def reference_05b(**overrides: Any) -> TinySpec:
    """The Qwen2.5-0.5B shape (random weights, bf16) that GPU benchmark figures use.

    24 layers, hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936,
    tied embeddings. `reference_05b().to_config()` is cheap. Building it writes about
    1 GB of weights with the small built-in tokenizer (a few hundred tokens): the
    config keeps vocabulary 151936, so the embedding matrix and FLOPs match the real
    model, while ids past the tokenizer's length are never produced by `encode` and
    decode to nothing. Use it for token-id workloads (fixed-length benchmarks), not text.
    """
    base = TinySpec(
        layers=24,
        hidden=896,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab_size=151936,
        max_position=32768,
        tie_embeddings=True,
        dtype="bfloat16",
    )
    return dataclasses.replace(base, **overrides)


PRESETS: dict[str, Callable[..., TinySpec]] = {"tiny": TinySpec, "qwen2.5-0.5b": reference_05b}


def preset(name: str, **overrides: Any) -> TinySpec:
    """The spec registered under `name` in PRESETS, with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name](**overrides)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    max_position: int = 2048,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    alphabet: str | None = None,
    tie_embeddings: bool = True,
    dtype: str = "float32",
    overwrite: bool = False,
    family: str = "qwen2",
) -> Path:
    """Build a random-weight model (Qwen2, or ``family``) plus tokenizer in `out_dir`;
    return its path.

    The tokenizer is `train_tokenizer(corpus, alphabet, vocab_size)` (the same for every
    `seed`); the weights depend only on the shape and `seed`: same arguments,
    byte-identical files. The directory is written under a temporary name and renamed
    into place, so it is never seen half-written. An existing non-empty `out_dir` is an
    error unless `overwrite=True`, which replaces it.
    """
    spec = TinySpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab_size=vocab_size,
        max_position=max_position,
        seed=seed,
        corpus=None if corpus is None else tuple(corpus),
        alphabet=alphabet,
        tie_embeddings=tie_embeddings,
        dtype=dtype,
        family=family,
    )
    return _write(spec, Path(out_dir).absolute(), overwrite)


def _write(spec: TinySpec, out: Path, overwrite: bool) -> Path:
    """Train the tokenizer, draw the weights, save both under a staging name, rename."""
    spec.validate()
    _check_target(out, overwrite)
    tokenizer = train_tokenizer(
        spec.corpus,
        spec.alphabet,
        vocab_size=spec.vocab_size,
        seed=TOKENIZER_SEED,
        model_max_length=spec.max_position,
    )
    model = random_model(spec.to_config(tokenizer), spec.seed, DTYPES[spec.dtype])
    model.generation_config = chat_generation_config(tokenizer)

    def save(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return write_model_dir(out, overwrite, save)


def write_model_dir(out: Path, overwrite: bool, save: Callable[[Path], None]) -> Path:
    """Run `save` on a staging folder beside `out`, then rename it to `out`: a model
    directory is never seen half-written. An existing non-empty `out` is an error unless
    `overwrite`, which replaces it."""
    _check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
    try:
        save(staging)
        for file in staging.iterdir():
            file.chmod(0o644)  # transformers writes weights owner-only
        _move_into_place(staging, out, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def count_parameters(model_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Parameter counts of a saved model, read from its safetensors headers.

    Returns `{"total": ..., "embedding": ..., "non_embedding": ...}`; tied weights are
    counted once. `non_embedding` is what FLOP counts use (6 x params x tokens).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}; is it a model directory?")
    total = embedding = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                numel = 1
                for dim in f.get_slice(key).get_shape():
                    numel *= dim
                total += numel
                embedding += numel if key.endswith("embed_tokens.weight") else 0
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def random_model(
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype,
    model_class: Callable[[PretrainedConfig], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """The config's causal LM (or `model_class`'s model) whose weights come only from
    `seed` (global RNG left untouched).

    Matrices ~ N(0, INIT_STD) drawn in parameter-name order from one generator; norm
    weights the identity (one; zero where the norm scales by ``1 + weight``); biases zero.
    """
    with torch.random.fork_rng(devices=[]):
        if model_class is not None:
            model = model_class(config)
        elif isinstance(config, Qwen2Config):
            model = Qwen2ForCausalLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    norm = 0.0 if config.model_type in NORM_ZERO else 1.0
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(norm)
    return model.to(dtype).eval()


def chat_generation_config(tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Stop at `<|im_end|>` (end of a chat turn) or `<|endoftext|>`; pad with the latter."""
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    return GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)


def _check_target(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"build_tiny_model: {out} is a file; pass a directory path.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"build_tiny_model: {out} is not empty; pass a new or empty directory, "
            "or overwrite=True (CLI: --overwrite) to replace it."
        )


def _move_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename `staging` to `out`; an existing `out` is removed only with `overwrite`."""
    _check_target(out, overwrite)
    if out.is_dir():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        shutil.rmtree(old)
    staging.rename(out)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

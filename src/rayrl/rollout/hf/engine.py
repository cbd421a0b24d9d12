"""A rollout engine on transformers models: simple, any HF causal LM.

Tokens are drawn by rayrl's seeded sampler (`rayrl.rollout.sampling`), so a
sample depends only on (seed, step, sample uid), never on the process-global RNG or on
the batch it is generated in.

The engine serves requests (`rayrl.rollout.requests`: add, step, abort,
weights changed between steps) on models that allow it (`requests.can_serve_requests`:
a decoder taking ``past_key_values`` and ``position_ids``, no sliding windows): every
live sample owns a row of one dynamic KV cache (`rayrl.rollout.hf.requests`),
and multi-turn episodes and asynchronous replicas run through the one turn loop
(`rayrl.rollout.loop`). `generate` is a thin loop over that API where the
engine's cache is ``dynamic`` (the default on a CPU). Otherwise (``cache="static"``, or
a model that cannot serve requests) `generate` runs ``generate()`` with the sampler
plugged in as a logits processor under greedy decoding (the processor samples each
row's token from its own counter-based noise and hands ``generate`` scores whose
argmax is that token) and a stopping criterion recording which rows ended on a stop
token or string, and when. The static cache is used where the model supports it; if
the static path fails once, the engine logs a warning and uses the dynamic cache from
then on; a model that cannot serve requests then decodes in
`rayrl.rollout.hf.decode.lean_decode` where it can.

A vision-language model (`rayrl.models.vision_language`) generates through
``generate()`` in `generate`: each prompt row's images (its ``multi_modal_inputs``) go
in stacked in row order with the image tokens marked, and ``generate()`` feeds the
pixels at the prefill and computes the model's M-RoPE positions, as it does for the
model's own users. It serves requests too (a prompt's images at ``add``, an
observation's at ``resume``: `rayrl.rollout.hf.requests` feeds their pixels and keeps
the M-RoPE positions), so multi-turn episodes that show it images and asynchronous
replicas run it through the one turn loop.

The engine wraps an existing module without copying
(``HFRolloutEngine(model=train_model, tok)``: the hybrid engine) or loads its own copy
(``HFRolloutEngine(model_path=...)``; with ``load_weights=False`` only the config and
tokenizer are read, and the first `update_weights` fills the copy).
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from rayrl import progress
from rayrl.batch import Batch
from rayrl.models.vision_language import IMAGE_COLUMN, is_vision_language, stack_images
from rayrl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, WeightSource
from rayrl.rollout.contract import (
    Responses,
    assemble_output,
    sample_rows,
)
from rayrl.rollout.hf.decode import can_lean_decode, decode_threads, lean_decode
from rayrl.rollout.hf.loading import load_model
from rayrl.rollout.hf.requests import HFRequests, can_serve_requests
from rayrl.rollout.loop import run_batch
from rayrl.rollout.requests import SampleOutput
from rayrl.rollout.sampling import SamplingParams, sample_keys, sample_tokens
from rayrl.rollout.special_ids import eos_ids, pad_id
from rayrl.rollout.turns import TurnDriver, TurnImages

__all__ = ["HFRolloutEngine"]

logger = logging.getLogger(__name__)
CACHE_IMPLEMENTATIONS = ("static", "dynamic")
DECODE_LOOPS = ("auto", "generate")


class _SeededSampler(LogitsProcessor):
    """Samples each row with `sample_tokens`; returns scores whose argmax is the sample.

    The scores are ``generate``'s own float32 copy of the step's logits: the chosen
    token's score is set to ``+inf`` in place (no new ``[N, vocab]`` tensor per step).
    Records the log-prob of every chosen token (one ``[N]`` tensor per decode step).
    """

    def __init__(
        self,
        keys: Tensor,
        prompt_len: int,
        params: SamplingParams,
    ) -> None:
        self.keys, self.prompt_len, self.params = keys, prompt_len, params
        self.log_probs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        position = input_ids.shape[1] - self.prompt_len
        tokens, log_probs = sample_tokens(scores, self.keys, position, self.params)
        self.log_probs.append(log_probs)
        progress.tick(tokens=len(tokens))
        return scores.scatter_(-1, tokens.unsqueeze(-1), float("inf"))


class _FinishTracker(StoppingCriteria):
    """Ends rows at a stop token or stop string; remembers each row's response length."""

    def __init__(
        self, n_rows: int, prompt_len: int, stop_ids: Tensor, strings: StopStringCriteria | None
    ) -> None:
        self.prompt_len, self.stop_ids, self.strings = prompt_len, stop_ids, strings
        self.stop_len = torch.zeros(n_rows, dtype=torch.long, device=stop_ids.device)
        self.done = torch.zeros(n_rows, dtype=torch.bool, device=stop_ids.device)

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:
        hit = torch.isin(input_ids[:, -1], self.stop_ids)
        if self.strings is not None:
            hit |= self.strings(input_ids, scores)
        first = hit & ~self.done
        self.stop_len = torch.where(first, input_ids.shape[1] - self.prompt_len, self.stop_len)
        self.done |= hit
        return self.done.clone()


def served_model(model: nn.Module) -> nn.Module:
    """The transformers model that decodes for ``model``: a PeftModel's wrapped model
    (its layers hold the LoRA adapters, active as the PeftModel's are), else itself."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None and hasattr(model, "peft_config"):
        return get_base()
    return model


@ROLLOUT_ENGINES.register("hf")
class HFRolloutEngine(RolloutEngine):
    """Rollout on ``model.generate()`` with seeded, replayable sampling.

    Args:
        model: an HF causal LM to generate with, used as is (no copy; the hybrid engine).
        tokenizer: its tokenizer; needed for stop strings, else optional.
        model_path: load a model (and tokenizer) from this HF directory instead.
        dtype: dtype for `model_path` loading ("bfloat16", torch.float32, ...; None: as saved).
        device: device for `model_path` loading (default: cuda if available, else cpu).
        cache: "static" (preallocated KV cache, falls back to dynamic) or "dynamic".
        compile: let transformers compile the decode step (static cache on GPU only).
        decode: "auto" (the lean loop with the dynamic cache where the model allows it,
            `decode.can_lean_decode`) or "generate" (always ``model.generate()``).
        config_overrides: values set on the config of the `model_path` model before it
            loads (verl's ``model.override_config``, `rayrl.models.config_overrides`).
        load_weights: False: read only `model_path`'s config and tokenizer; the
            weights come from `update_weights` (a generation before that fails).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        tokenizer=None,
        *,
        model_path: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        cache: str = "static",
        compile: bool = False,
        decode: str = "auto",
        config_overrides: dict | None = None,
        load_weights: bool = True,
    ) -> None:
        if (model is None) == (model_path is None):
            raise ValueError(
                "HFRolloutEngine: pass exactly one of model= (an nn.Module to share) or "
                "model_path= (an HF model directory to load)."
            )
        if cache not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"HFRolloutEngine: cache={cache!r} is not one of {CACHE_IMPLEMENTATIONS}."
            )
        if decode not in DECODE_LOOPS:
            raise ValueError(f"HFRolloutEngine: decode={decode!r} is not one of {DECODE_LOOPS}.")
        if model_path is not None:
            model, tokenizer = load_model(
                model_path, tokenizer, dtype, device, config_overrides, load_weights
            )
        assert model is not None  # exactly one of model, model_path (checked above)
        # parameters no load has filled yet (load_weights=False), by identity (tied: one)
        self._unset = set() if load_weights else {id(p) for p in model.parameters()}
        self.model = model
        self.tokenizer = tokenizer
        self.owns_weights = model_path is not None
        self.cache = cache
        self.compile = compile
        # a vision-language model generates with its images through ``generate()``,
        # which computes its M-RoPE positions and feeds the pixels at the prefill only
        self.vision = is_vision_language(getattr(model, "config", None) or {})
        # a LoRA model (a PeftModel) decodes through the transformers model it wraps,
        # whose layers carry the adapters: the same tokens, with the lean decoder and
        # requests (multi-turn episodes, async replicas) that a PeftModel lacks
        self.served = served_model(model)
        self.lean = decode == "auto" and can_lean_decode(self.served) and not self.vision
        self._asleep = False
        gen_config = getattr(model, "generation_config", None)
        self.eos_ids = eos_ids(gen_config, getattr(model, "config", None), tokenizer)
        self.pad_id = pad_id(gen_config, tokenizer, self.eos_ids, "HFRolloutEngine")
        self.serves = can_serve_requests(self.served)
        self.requests = HFRequests(self.served, self.pad_id, self.eos_ids, tokenizer)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt; see `RolloutEngine.generate`."""
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.generate: the engine is asleep; call wake() first.")
        self._require_weights("generate")
        if sampling.stop and self.tokenizer is None:
            raise ValueError(
                "HFRolloutEngine.generate: stop strings need a tokenizer; build the engine "
                "with tokenizer=... or drop SamplingParams.stop."
            )
        samples = sample_rows(prompts, sampling.n, sampling.seed, "HFRolloutEngine.generate")
        if len(samples.rows) == 0:
            none = torch.zeros(0, 0)
            out = Responses(none.long(), none.sum(1).long(), none, none.sum(1).bool())
        elif self.serves and self.cache == "dynamic" and not self.vision:
            keys = samples.keys.numpy()
            out = self.generate_token_ids(samples.token_lists(), sampling, keys=keys)
        else:
            with decode_threads(self.model, _device_of(self.model)):
                out = self._generate_rows(samples.rows, samples.keys, sampling)
        width = sampling.max_new_tokens
        return assemble_output(samples.rows, samples.uids, out, width, self.pad_id)

    def generate_token_ids(
        self,
        prompts,
        sampling: SamplingParams,
        *,
        keys: np.ndarray | None = None,
        max_new_tokens=None,
        turns: TurnDriver | None = None,
        images=None,
    ) -> Responses:
        """Generate from unpadded token-id prompts (rows as in `generate`, samples
        adjacent): a thin loop over the request API (`rayrl.rollout.loop`), as
        the native engine's; ``turns`` runs multi-turn episodes; ``images``: per prompt,
        its pixel inputs (`rayrl.rollout.loop.Job.images`)."""
        self._require_weights("generate")
        self._require_requests()
        n_rows = len(prompts) * sampling.n
        if keys is None:
            uids = [f"{i}/{k}" for i in range(len(prompts)) for k in range(sampling.n)]
            keys = sample_keys(sampling.seed, 0, uids).numpy()
        limits = np.full(n_rows, sampling.max_new_tokens, dtype=np.int64)
        if max_new_tokens is not None:
            limits = np.asarray(max_new_tokens, dtype=np.int64).reshape(n_rows)
        arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
        keys = np.asarray(keys, dtype=np.int64)
        return run_batch(self, arrays, sampling, keys, limits, turns, images=images)

    def prepare_call(self, prompts, keys, limits, sampling: SamplingParams, turns):
        """Check a call before any of its prompts runs; the turn driver to run it with."""
        self._require_weights("generate")
        self._require_requests()
        if sampling.stop and self.tokenizer is None:
            raise ValueError("HFRolloutEngine: stop strings need a tokenizer.")
        return turns

    @contextlib.contextmanager
    def measured(self, with_turns: bool) -> Iterator[dict[str, float]]:
        """A call's timing (the HF engine keeps no loop stats of its own)."""
        yield {}

    # ------------------------------------------------------------------ requests
    def _require_requests(self) -> None:
        if self._asleep:
            raise RuntimeError("HFRolloutEngine: the engine is asleep; call wake() first.")
        if not self.serves:
            raise NotImplementedError(
                f"HFRolloutEngine: {type(self.model).__name__} cannot serve requests (multi-"
                "turn episodes, asynchronous replicas): that needs a decoder-only transformers "
                "model that takes past_key_values and position_ids, without sliding-window "
                "layers. Use a Qwen2/Qwen3/Llama-style model, or single-turn synchronous rollouts."
            )

    def add(
        self, prompt, keys, limits, sampling: SamplingParams, *, park: bool = False, images=None
    ):
        """Queue one prompt and its samples (`rayrl.rollout.requests`); their ids.
        ``images``: the prompt's pixel inputs (a vision-language model's)."""
        self._require_weights("generate")
        self._require_requests()
        if sampling.stop and self.tokenizer is None:
            raise ValueError("HFRolloutEngine: stop strings need a tokenizer.")
        return self.requests.add(prompt, keys, limits, sampling, park=park, images=images)

    def resume(self, sample: int, tokens, images: TurnImages | None = None) -> None:
        self.requests.resume(sample, tokens, images)

    def prompt_images(
        self, prompts: Batch, token_lists: list[list[int]], sampling: SamplingParams
    ) -> list[Any] | None:
        """The prompts' pixel inputs (their ``multi_modal_inputs``), as `add` takes them
        (None for a prompt without images; None: no prompt has any)."""
        column = prompts.non_tensors.get(IMAGE_COLUMN)
        return None if column is None else [dict(x) if x else None for x in column]

    def finish(self, sample: int, stopped: bool) -> None:
        self.requests.finish(sample, stopped)

    def abort(self, samples) -> None:
        self.requests.abort(samples)

    def step(self) -> list[tuple[int, str]]:
        """One forward over the live samples (`rayrl.rollout.hf.requests`); the events since the last."""
        device = _device_of(self.model)
        with decode_threads(self.model, device), _eval_mode(self.model):
            return self.requests.step()

    def output(self, sample: int) -> SampleOutput:
        return self.requests.output(sample)

    def release(self, samples) -> None:
        self.requests.release(samples)

    def drain(self) -> None:
        """Nothing is ever in flight between the HF engine's steps."""

    @property
    def serves_requests(self) -> bool:
        """Whether the model can serve requests (`requests.can_serve_requests`)."""
        return self.serves

    @property
    def busy(self) -> bool:
        return self.requests.live > 0

    @property
    def stalled(self) -> bool:
        return self.requests.stalled

    @property
    def parked(self) -> int:
        return int(self.requests.s.parked.sum())

    @property
    def live(self) -> int:
        return self.requests.live

    @property
    def draws_with(self) -> SamplingParams | None:
        return self.requests.sampling if self.requests.live else None

    @property
    def version(self) -> int:
        return self.requests.version

    @version.setter
    def version(self, value: int) -> None:
        self.requests.version = int(value)

    def _generate_rows(self, rows: Batch, keys: Tensor, sampling: SamplingParams) -> Responses:
        """Run ``generate``; if the static cache fails and the dynamic one works, switch.

        An error that the dynamic cache hits too is raised as is (the engine stays static).
        """
        try:
            return self._run_generate(rows, keys, sampling, self.cache)
        except Exception as err:
            if self.cache != "static":
                raise
            out = self._run_generate(rows, keys, sampling, "dynamic")
            logger.warning(
                "HFRolloutEngine: generate with a static KV cache failed for %s (%s: %s); "
                "using the dynamic cache from now on.",
                type(self.model).__name__,
                type(err).__name__,
                err,
            )
            self.cache = "dynamic"
            return out

    def _run_generate(
        self, rows: Batch, keys: Tensor, sampling: SamplingParams, cache: str
    ) -> Responses:
        device = _device_of(self.model)
        columns = ("input_ids", "attention_mask", "position_ids")
        inputs = {name: rows.tensors[name].to(device) for name in columns}
        if self.vision:
            inputs = self._with_images(rows, inputs, device)
        prompt_len = inputs["input_ids"].shape[1]
        stop_ids = self._stop_ids(sampling, device)
        strings = StopStringCriteria(self.tokenizer, list(sampling.stop)) if sampling.stop else None
        if cache == "dynamic" and self.lean and not self.compile:
            with _generation_mode(self.model):
                return lean_decode(
                    self.served,
                    inputs,
                    keys.to(device),
                    sampling,
                    stop_ids,
                    strings,
                    self.pad_id,
                )
        sampler = _SeededSampler(keys.to(device), prompt_len, sampling)
        tracker = _FinishTracker(len(rows), prompt_len, stop_ids, strings)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop_ids.tolist() or None,
            pad_token_id=self.pad_id,
            cache_implementation="static" if cache == "static" else None,
            disable_compile=not self.compile,
        )
        with _generation_mode(self.model):
            sequences = self.model.generate(
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([tracker]),
            )
        tokens = sequences[:, prompt_len:]
        steps = tokens.shape[1]
        log_probs = torch.stack(sampler.log_probs, dim=1)[:, :steps]
        lengths = torch.where(
            tracker.done, tracker.stop_len, torch.full_like(tracker.stop_len, steps)
        )
        return Responses(tokens, lengths, log_probs, tracker.done)

    def _with_images(self, rows: Batch, inputs: dict, device: torch.device) -> dict:
        """A vision-language model's ``generate()`` inputs: its rows' images stacked in
        row order (`stack_images`), the image tokens marked (``mm_token_type_ids``, from
        which it computes the M-RoPE positions), and no text positions."""
        ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
        marked = (ids == int(self.model.config.image_token_id)) & mask
        out = {"input_ids": ids, "attention_mask": inputs["attention_mask"]}
        out["mm_token_type_ids"] = marked.int()
        column = rows.non_tensors.get(IMAGE_COLUMN)
        images = stack_images(column) if column is not None else None
        if images is not None:
            out.update({k: v.to(device) for k, v in images.items()})
        elif bool(marked.any()):
            raise ValueError(
                "HFRolloutEngine.generate: the prompts hold image tokens but no "
                "multi_modal_inputs column with their images; send the prompt rows' "
                "multi_modal_inputs (rayrl.data.dataset collates them)"
            )
        return out

    def _require_weights(self, call: str) -> None:
        if self._unset:
            raise RuntimeError(
                f"HFRolloutEngine.{call}: built with load_weights=False and {len(self._unset)} "
                "of its weights were never set; call update_weights with the full weights "
                "first"
            )

    def _stop_ids(self, sampling: SamplingParams, device: torch.device) -> Tensor:
        ids = [] if sampling.ignore_eos else list(self.eos_ids)
        ids += [i for i in sampling.stop_token_ids if i not in ids]
        return torch.tensor(ids, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: WeightSource, *, version: int | None = None) -> int:
        """Copy tensors into the model in place by name; see `RolloutEngine.update_weights`.
        Samples may be in flight (they keep their caches); tokens drawn afterwards carry
        ``version`` when given.

        Raises:
            KeyError: a name the model does not have (with the closest names it has).
            ValueError: a tensor whose shape differs from the model's.
        """
        if version is not None:
            self.requests.version = int(version)
        targets = self.model.state_dict(keep_vars=True)
        items = weights.items() if isinstance(weights, Mapping) else weights
        copied = 0
        with torch.no_grad():
            for name, tensor in items:
                target = targets.get(name)
                if target is None:
                    close = difflib.get_close_matches(name, list(targets), n=3)
                    raise KeyError(
                        f"HFRolloutEngine.update_weights: the model has no tensor {name!r}; "
                        f"closest names: {close}. Pass unwrapped (HF) parameter names."
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"HFRolloutEngine.update_weights: {name!r} has shape "
                        f"{tuple(tensor.shape)} but the model's is {tuple(target.shape)}; "
                        "pass full (unsharded) tensors."
                    )
                self._unset.discard(id(target))
                if _same_storage(tensor, target):
                    continue
                target.data.copy_(tensor.data)
                copied += 1
        return copied

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """On a GPU, drop generation memory: the static cache's sizing, Python garbage,
        the CUDA allocator cache. On a CPU there is no device memory to give back: the
        engine only marks itself asleep (a full ``gc.collect`` and a fresh static cache
        there took about half of a small step: docs/benchmarks.md, run C)."""
        if self._asleep:
            return
        if self.requests.live:
            raise RuntimeError(
                f"HFRolloutEngine.sleep: {self.requests.live} samples are in flight; finish or "
                "abort them first"
            )
        self._asleep = True
        if _device_of(self.model).type != "cuda":
            return
        with contextlib.suppress(AttributeError):
            del self.model._previous_max_cache_length  # next static cache sized afresh
        gc.collect()
        torch.cuda.empty_cache()

    def wake(self) -> None:
        """Ready to generate again; the KV cache is reallocated by the next `generate`."""
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        """True between `sleep` and `wake`."""
        return self._asleep


# ---------------------------------------------------------------------- helpers
def _device_of(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for a step of the model; its mode restored after."""
    training = model.training
    if training:
        model.eval()
    try:
        yield
    finally:
        if training:
            model.train(True)


@contextlib.contextmanager
def _generation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and a neutral ``model.generation_config`` during ``generate``; both restored.

    ``generate`` fills every option the caller leaves unset from the model's own
    generation config (a checkpoint's repetition penalty, say), which would change the
    distribution rayrl samples from; a blank one keeps only what the engine sets.
    """
    training, saved = model.training, getattr(model, "generation_config", None)
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
        model.train(training)

"""`NativeRolloutEngine`: rayrl's own generation engine for the model families of `families`.

It runs HF decoder models from their HF weights with its own forward
(`rayrl.rollout.native.model`): bf16 weights on CUDA (float32 on CPU),
continuous batching with chunked prefill (`scheduler`) over a preallocated paged KV
cache sized from ``gpu_memory_utilization`` (`kv_cache`), the n samples of a prompt
sharing one prefill, a GQA-aware split-KV decode attention kernel and fused
norm/rotary/activation kernels in Triton on CUDA (plain torch on CPU), the decode
step captured in CUDA graphs for a set of batch sizes (`graphs`) and small prefill
steps for a set of token counts (`prefill_graphs`), and sampling on the
device with the HF engine's seeded draws (`sampler`). Same interface and output
contract as the ``hf`` engine; ``make_rollout_engine("native", model_path=...)``.

With ``tp_size`` > 1 the model is split over the ranks of ``tp_group`` (tensor
parallelism: `shards` says who holds what, `tp` how replicas form and run in lockstep,
`tp_sampler` how a token is drawn over the split vocabulary): each rank holds its
slice of the weights and its KV heads' cache, and every rank of the group returns the
same tokens as one unsplit engine would.

Multi-turn episodes (`generate_token_ids` with a `TurnDriver`): a sample whose turn
ends leaves the running set while the driver works (its tools run); the others keep
decoding, and it rejoins with the driver's tokens prefilled onto its own KV cache
(`scheduler`). Samples whose answers come back while others decode are prefilled
together, not one prefill step each (``resume_prefill_cost``), in a step queued behind
the decode step in flight: the device runs it while the host commits that step, and
the next decode step takes the prefilled samples' first tokens from the device (no
drain of the overlapped decoding, no wait for them). Tensor-parallel, the
episodes run on TP rank 0 and its answers reach the other ranks of the replica by
broadcast (`tp_turns`).

A vision-language model (Qwen2-VL, Qwen2.5-VL: `families.qwen2_vl`) runs its own vision
tower, transformers' (`vision`), on the images of each prompt row (its
``multi_modal_inputs``) once per `generate`; their features go into the prefill at the
image placeholders, every token rotates by its M-RoPE positions, and each sample's
decode positions continue from its prompt's ``rope_delta`` (`images`). KV blocks are
cached by the prompt's images as well as its tokens (`prefix_cache`). Weight updates
fill the tower too (a trained tower's, or merger's, new weights). Single-turn and
synchronous with images, as the hf engine; not tensor-parallel yet.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from rayrl.batch import Batch
from rayrl.config.quantization import QUANTIZATIONS
from rayrl.models.vision_language import IMAGE_COLUMN
from rayrl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, WeightSource
from rayrl.rollout.contract import Responses, assemble_output, sample_rows
from rayrl.rollout.loop import run_batch
from rayrl.rollout.native.attention import choose_kernels, triton_gaps
from rayrl.rollout.native.families import family_for, rotary_tables, spec_of
from rayrl.rollout.native.images import PromptImages
from rayrl.rollout.native.kv_cache import BlockAllocator, KVCache, cache_blocks_for
from rayrl.rollout.native.loop_stats import call_stats, engine_counters, loop_stats
from rayrl.rollout.native.model import NativeModel
from rayrl.rollout.native.prefill_graphs import PREFILL_GRAPH_TOKENS, PrefillGraphs
from rayrl.rollout.native.prefix_cache import PrefixCache
from rayrl.rollout.native.routes import RouteStore
from rayrl.rollout.native.runner import ModelRunner
from rayrl.rollout.native.scheduler import Scheduler
from rayrl.rollout.native.serving import Serving
from rayrl.rollout.native.sources import engine_dtype, engine_sources
from rayrl.rollout.native.spec import UnsupportedModelError
from rayrl.rollout.native.step_loop import Stepper
from rayrl.rollout.native.tp import call_fingerprint, digest, tensor_parallel_for
from rayrl.rollout.native.tp_sampler import SplitVocabSampler
from rayrl.rollout.native.tp_turns import LockstepTurns
from rayrl.rollout.native.vision import VisionEncoder
from rayrl.rollout.native.weights import NativeWeights, read_safetensors
from rayrl.rollout.sampling import SamplingParams, sample_keys
from rayrl.rollout.special_ids import eos_ids, pad_id
from rayrl.rollout.turns import TurnDriver

__all__ = ["NativeRolloutEngine"]


logger = logging.getLogger(__name__)
# The KV cache holds at most this many times what max_num_seqs full-length sequences
# use: room for samples parked between turns (multi-turn) beside the running ones.
CACHE_HEADROOM = 2
# Multi-turn: a prefill step of resumed samples costs about this many CUDA-graph decode
# steps of a small model: eager, and replayed from a prefill graph queued behind the
# decode step in flight (bench/rollout.py's workload M on an H200, docs/benchmarks.md:
# 0.5 gave the most tokens/s of 0, 0.5 and 1 there; 1 was best, of 0, 0.5, 1, 2 and 4,
# while the prefill drained the overlapped decoding and waited for its tokens).
RESUME_PREFILL_COST = 4.0
RESUME_PREFILL_COST_GRAPHS = 0.5
RESUME_MAX_WAIT = 16  # decode steps a resumed sample waits for its prefill at most
WHERE = "NativeRolloutEngine"


@ROLLOUT_ENGINES.register("native")
class NativeRolloutEngine(Serving, RolloutEngine):
    """Continuous-batching rollout over a paged KV cache; see the module docstring.

    Args:
        model: an HF causal LM whose config and weights to take (copied, not shared).
        tokenizer: its tokenizer; needed for stop strings (loaded with ``model_path``).
        model_path: load the model (and tokenizer) from this HF directory instead.
        dtype: weight and cache dtype (default: bfloat16 on CUDA, float32 on CPU).
        device: default cuda when available, else cpu (``model``: its device).
        gpu_memory_utilization: fraction of the GPU the engine may use, weights,
            activations and KV cache together (verl / vLLM semantics).
        max_num_seqs: sequences decoded together at most (the batch slots).
        max_num_batched_tokens: prompt tokens per prefill step (chunked prefill).
        max_model_len: longest prompt + response (default: the model's maximum).
        block_size: tokens per KV cache block.
        enforce_eager: never use CUDA graphs.
        overlap_decode: plan and launch each decode step before committing the last one's
            tokens, which stay on the device as the next step's inputs (stops are found a
            step late; that step's token is dropped). False: commit every step first.
        cpu_cache_tokens: KV cache size in tokens on CPU.
        kernels: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton" (on CPU
            only under ``TRITON_INTERPRET=1``, for tests).
        tp_size: ranks the model is split over (``actor_rollout_ref.rollout.
            tensor_model_parallel_size``); more than 1 needs ``tp_group``.
        tp_group: the torch.distributed group of this rank's replica
            (`rayrl.rollout.native.tp.make_tp_groups`); every rank of it builds
            its engine with the same arguments and makes the same calls.
        config_overrides: values set on the config loaded from ``model_path`` (verl's
            ``model.override_config``, `rayrl.models.config_overrides`).
        load_weights: False: read only ``model_path``'s config and tokenizer, not its
            weights, which a complete `update_weights` must then fill before the first
            `generate` (a hybrid actor's first weight sync does: the checkpoint is read
            once, by the training engine).
        resume_prefill_cost: multi-turn episodes: what a prefill step costs the running
            samples, in decode steps; samples whose tool answers came back wait to be
            prefilled together until the decode steps they lost waiting add up to this
            many per running sample (or ``resume_max_wait`` steps). 0: prefill each
            answer at the next step. Default: 0.5 where small prefill steps run in CUDA
            graphs (``prefill_graph_tokens``), 4 where they are eager.
        resume_max_wait: the most decode steps such a sample waits.
        prefill_graph_tokens: prefill steps of at most this many tokens run in CUDA
            graphs, one per token-count bucket (`prefill_graphs`; the Triton kernels, no
            tensor parallelism). 0: every prefill step is eager.
        enable_prefix_caching: full KV blocks are found again by the tokens they hold
            (`prefix_cache`: a prompt seen before, an episode recomputed after a
            preemption prefill only what is new); forgotten at new weights and sleep.
        record_routes: a mixture-of-experts model records the experts every token of a
            sample (prompt and response) was routed to (`routes`): the outputs carry
            them (`SampleOutput.routes`, the ``routed_experts`` column), for training
            to replay (verl's ``rollout.enable_rollout_routing_replay``). Nothing to
            record for a dense model.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        tokenizer=None,
        *,
        model_path: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        block_size: int = 16,
        enforce_eager: bool = False,
        overlap_decode: bool = True,
        cpu_cache_tokens: int = 65536,
        kernels: str = "auto",
        tp_size: int = 1,
        tp_group=None,
        config_overrides: dict | None = None,
        load_weights: bool = True,
        resume_prefill_cost: float | None = None,
        resume_max_wait: int = RESUME_MAX_WAIT,
        prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
        enable_prefix_caching: bool = True,
        record_routes: bool = False,
        quantization: str | None = None,
    ) -> None:
        if (model is None) == (model_path is None):
            raise ValueError(
                f"{WHERE}: pass exactly one of model= (an HF module to copy) or model_path= "
                "(an HF model directory to load)."
            )
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"{WHERE}: quantization={quantization!r} is not one of {QUANTIZATIONS}."
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"{WHERE}: gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]."
            )
        config, gen_config, tokenizer, device = engine_sources(
            model, model_path, tokenizer, device, config_overrides
        )
        self.device = torch.device(device)
        self.dtype = engine_dtype(dtype, self.device)
        self.spec = spec_of(config)
        if self.spec.mrope and tp_size > 1:
            raise UnsupportedModelError(
                f"{WHERE}: tp_size={tp_size} on a vision-language model ({self.spec.model_type}) "
                "is not built yet (issue 48); set actor_rollout_ref.rollout."
                "tensor_model_parallel_size=1, or use actor_rollout_ref.rollout.name=hf"
            )
        self.tp = tensor_parallel_for(self.spec, tp_size, tp_group, self.device, WHERE)
        # a vision-language model's tower (its weights come with the model's, below)
        self.vision = VisionEncoder(config, self.dtype, self.device) if self.spec.mrope else None
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids(gen_config, config, tokenizer)
        self.pad_id = pad_id(gen_config, tokenizer, self.eos_ids, WHERE)
        self.max_model_len = int(max_model_len or self.spec.max_positions)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        if prefill_graph_tokens < 0:
            raise ValueError(f"{WHERE}: prefill_graph_tokens={prefill_graph_tokens} must be >= 0.")
        self.prefill_graph_tokens = min(prefill_graph_tokens, max_num_batched_tokens)
        shard = self.tp.shard if self.tp else None
        self.weights = NativeWeights(self.spec, self.dtype, self.device, shard, quantization)
        self.local_spec = self.weights.spec  # this rank's slice (the spec without TP)
        self._unset: set[str] = set()  # weights no load has filled yet
        if model_path and not load_weights:
            self._unset = self._needed()
        elif model_path:  # tensor-parallel: each rank reads its parts of the files only
            parts = read_safetensors(model_path, shard.part if shard is not None else None)
            self._load_all(parts, sharded=shard is not None)
        else:
            assert model is not None  # exactly one of model, model_path (checked above)
            self._load_all(model.state_dict().items())
        cos, sin = rotary_tables(config, self.max_model_len, self.device)
        self.kernels = choose_kernels(kernels, self.device, self.spec.head_dim)
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.use_prefill_graphs = (
            self.use_graphs
            and self.kernels == "triton"
            and self.tp is None
            and self.prefill_graph_tokens > 0
        )
        self.model = NativeModel(self.local_spec, self.weights, cos, sin, self.kernels, self.tp)
        if self.spec.mrope:
            self.model.mrope_rotary = family_for(config).mrope_rotary(config, self.device)
        moe = self.local_spec.moe if record_routes else None
        blocks = cache_blocks_for(
            self.local_spec,
            self.dtype,
            block_size,
            device=self.device,
            gpu_memory_utilization=gpu_memory_utilization,
            engine_bytes=self.weights.nbytes() + self._vision_bytes() + self._activation_bytes(),
            cpu_cache_tokens=cpu_cache_tokens,
            max_blocks=CACHE_HEADROOM * max_num_seqs * -(-self.max_model_len // block_size),
            extra_bytes_per_token=RouteStore.bytes_per_slot(moe) if moe else 0,
        )
        if self.tp:  # the same blocks and settings on every rank: the same schedule
            count = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            blocks = int(self.tp.all_reduce(count, dist.ReduceOp.MIN).item())
            settings = (block_size, max_num_seqs, max_num_batched_tokens, self.max_model_len)
            self.tp.agree(digest(repr((settings, overlap_decode)).encode()), "engine settings")
        self.cache = KVCache(self.local_spec, blocks, block_size, self.dtype, self.device)
        width = -(-self.max_model_len // block_size)
        sampler = SplitVocabSampler(self.tp) if self.tp else None
        self.runner = ModelRunner(self.model, self.cache, max_num_seqs, width, sampler)
        self.overlap = overlap_decode
        if resume_prefill_cost is None:
            graphed = self.use_prefill_graphs
            resume_prefill_cost = RESUME_PREFILL_COST_GRAPHS if graphed else RESUME_PREFILL_COST
        if resume_prefill_cost < 0 or resume_max_wait < 0:
            raise ValueError(
                f"{WHERE}: resume_prefill_cost={resume_prefill_cost} and resume_max_wait="
                f"{resume_max_wait} must be >= 0."
            )
        self.resume_prefill_cost, self.resume_max_wait = resume_prefill_cost, resume_max_wait
        allocator = BlockAllocator(self.cache.num_blocks)
        self.prefix = PrefixCache(allocator, block_size) if enable_prefix_caching else None
        self.sched = Scheduler(
            allocator=allocator,
            prefix=self.prefix,
            block_size=block_size,
            max_batched_tokens=max_num_batched_tokens,
            table=self.runner.table_host,
            stop_ids=np.zeros(0, dtype=np.int64),
            resume_cost=resume_prefill_cost,
            resume_max_wait=resume_max_wait,
            capacity=max_num_seqs,
        )
        self.routes = None  # each token's experts (`record_routes`; a mixture of experts)
        if moe is not None:
            self.routes = RouteStore(moe, self.cache.num_blocks * block_size, self.device)
            self.model.routes = self.routes
            self.sched.on_finish = functools.partial(self.routes.on_finish, self.sched)
        self.stats: dict[str, float] = loop_stats(with_turns=True)  # since the engine began
        self.stepper = Stepper(self.runner, self.sched, overlap_decode, self.stats)
        self._asleep = False
        self.last_stats: dict[str, int] = {}

    @classmethod
    def unsupported_reason(cls, device_type: str, model_config: Any) -> str | None:
        """``auto`` picks this engine on CUDA for the models a family of it runs
        (`rayrl.rollout.native.families`) whose needs its Triton kernels meet."""
        if device_type != "cuda":
            return f"its kernels and CUDA graphs are for GPUs, not {device_type}"
        try:
            spec = spec_of(model_config)
        except UnsupportedModelError as err:
            return str(err)
        if spec.mrope:  # its image prefill is tested on CPU only: asked for by name
            return "a vision-language model runs on it when named (rollout.name=native)"
        return triton_gaps(spec, spec.max_positions)

    @classmethod
    def config_options(cls, rollout: Any, data: Any) -> dict[str, Any]:
        """verl's vLLM keys of the ``rollout`` group; the longest sequence defaults to
        the longest prompt plus the longest response; each token's experts are recorded
        with ``enable_rollout_routing_replay``; ``quantization`` (fp8) keeps the
        dense layers' matrices in FP8 (`rayrl.rollout.native.fp8`)."""
        return {
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
            "enable_prefix_caching": rollout.enable_prefix_caching,
            "max_num_seqs": rollout.max_num_seqs,
            "max_num_batched_tokens": rollout.max_num_batched_tokens,
            "enforce_eager": rollout.enforce_eager,
            "max_model_len": rollout.max_model_len
            or data.max_prompt_length + data.max_response_length,
            "record_routes": rollout.enable_rollout_routing_replay,
            "quantization": rollout.quantization,
        }

    def _needed(self) -> set[str]:
        """The names a complete load fills."""
        names = set(self.weights.names)
        if self.vision is not None:
            names.update(self.vision.names)
        if self.spec.tie_embeddings:
            names.discard("lm_head.weight")
        return names

    def _load_all(self, state, sharded: bool = False) -> None:
        seen: list[str] = []
        self.weights.load(_noting(self._routed(state, seen), seen), WHERE, sharded)
        missing = self._needed() - self.weights.filled(seen)
        if missing:
            raise KeyError(
                f"{WHERE}: the checkpoint lacks {len(missing)} tensors the model needs, e.g. "
                f"{sorted(missing)[:3]}; is it a complete {self.spec.model_type} checkpoint?"
            )

    def _routed(
        self, pairs: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], seen: list[str]
    ) -> Iterable[tuple[str, Tensor]]:
        """``pairs`` for the language model's weights: a vision-language model's tower
        tensors copied into its tower on the way (noted in ``seen``), the others renamed
        as on disk (`vision.VisionEncoder.take`)."""
        pairs = pairs.items() if isinstance(pairs, Mapping) else pairs
        return pairs if self.vision is None else self.vision.take(pairs, seen)

    def _vision_bytes(self) -> int:
        return 0 if self.vision is None else self.vision.nbytes()

    def _activation_bytes(self) -> int:
        """Upper bound of the memory a step needs besides weights and cache (the logits
        of the whole vocabulary: tensor-parallel top-k / top-p gathers them), and the
        prefill graphs' pool beside it."""
        s, size = self.local_spec, torch.empty((), dtype=self.dtype).element_size()
        per_token = 5 * s.hidden + 2 * s.q_size + 2 * s.kv_size + 3 * s.intermediate
        if s.moe is not None:  # each token's k expert rows (sorted copies, outputs)
            per_token += s.moe.experts + s.moe.top_k * (2 * s.hidden + 3 * s.moe.intermediate)
        logits = self.max_num_seqs * self.spec.vocab * (size + 16)  # logits, copies, sampler
        tokens = self.max_num_batched_tokens
        if self.use_prefill_graphs:
            tokens += self.prefill_graph_tokens
        return tokens * per_token * size + logits + (256 << 20)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt; see `RolloutEngine.generate`."""
        samples = sample_rows(prompts, sampling.n, sampling.seed, f"{WHERE}.generate")
        token_lists, keys = samples.token_lists(), samples.keys.numpy()
        images = self.prompt_images(samples.prompts, token_lists, sampling)
        out = self.generate_token_ids(token_lists, sampling, keys=keys, images=images)
        width = sampling.max_new_tokens
        return assemble_output(samples.rows, samples.uids, out, width, self.pad_id)

    def prompt_images(
        self, prompts: Batch, token_lists: list[list[int]], sampling: SamplingParams
    ) -> list[PromptImages | None] | None:
        """A vision-language model's prompts' images (`vision.VisionEncoder.prompt_images`,
        from the rows' ``multi_modal_inputs``), for `add`; None for a text model."""
        if self.vision is None or not token_lists:
            return None
        self._check_ready(sampling)  # its tower's weights are set
        column = prompts.non_tensors.get(IMAGE_COLUMN)
        rows = list(column) if column is not None else [None] * len(token_lists)
        arrays = [np.asarray(p, dtype=np.int64) for p in token_lists]
        return self.vision.prompt_images(arrays, rows)

    def generate_token_ids(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        keys: np.ndarray | None = None,
        max_new_tokens: Sequence[int] | None = None,
        turns: TurnDriver | None = None,
        images: Sequence[PromptImages | None] | None = None,
    ) -> Responses:
        """Generate from unpadded token-id prompts; rows as in `generate` (samples
        adjacent): a thin loop over the request API (`rayrl.rollout.loop`).

        Args:
            keys: one int64 sample key per output row (default: from ``sampling.seed``,
                step 0 and uids ``f"{i}/{k}"``).
            max_new_tokens: a length limit per output row (default: ``sampling.max_new_tokens``).
            turns: multi-turn episodes: the driver told of every turn end (see
                `rayrl.rollout.turns`). The responses then hold the appended
                tokens too (log-prob 0), and the length limit counts them. Tensor-
                parallel, TP rank 0's driver runs the episodes and the other ranks
                apply its answers (`tp_turns`); they pass `tp_turns.FollowerTurns`.
            images: a vision-language model's prompts' images, one per prompt (None: a
                text prompt), as `generate` makes them from the rows.
        """
        n_rows = len(prompts) * sampling.n
        if keys is None:
            uids = [f"{i}/{k}" for i in range(len(prompts)) for k in range(sampling.n)]
            keys = sample_keys(sampling.seed, 0, uids).numpy()
        limits = np.full(n_rows, sampling.max_new_tokens, dtype=np.int64)
        if max_new_tokens is not None:
            limits = np.asarray(max_new_tokens, dtype=np.int64).reshape(n_rows)
        arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
        keys = np.asarray(keys, dtype=np.int64)
        turns = self.prepare_call(arrays, keys, limits, sampling, turns)
        if n_rows == 0:
            empty = torch.zeros(0, 0)
            return Responses(empty.long(), empty.sum(1).long(), empty, empty.sum(1).bool())
        with self.measured(with_turns=turns is not None) as timing:
            return run_batch(
                self, arrays, sampling, keys, limits, turns, stats=timing, images=images
            )

    def prepare_call(
        self,
        prompts: list[np.ndarray],
        keys: np.ndarray,
        limits: np.ndarray,
        sampling: SamplingParams,
        turns: TurnDriver | None,
    ) -> TurnDriver | None:
        """Check a call's prompts before any of them runs; the turn driver to run it
        with (tensor-parallel: every rank of the replica agrees on the call first, and
        TP rank 0's episodes are applied in lockstep, `tp_turns`)."""
        self._check_ready(sampling)
        if self.tp:  # before anything that could end one rank's call but not another's
            self.tp.agree(call_fingerprint(prompts, keys, limits, sampling), "prompts or sampling")
        self._check_lengths(prompts, limits, sampling.n)
        if turns is not None and self.tp:
            turns = LockstepTurns(turns, self.tp)
        return turns

    @contextlib.contextmanager
    def measured(self, with_turns: bool) -> Iterator[dict[str, float]]:
        """Time a call into `last_stats`: the engine's counters' growth over it, plus
        the seconds its caller adds to the dict yielded (its turn loop's)."""
        before = engine_counters(self)
        start = time.perf_counter()
        self.runner.sampler.wait_s = 0.0
        timing: dict[str, float] = {}
        try:
            yield timing
        finally:
            self.last_stats = call_stats(self, before, start, timing, with_turns)

    def _check_ready(self, sampling: SamplingParams) -> None:
        if self._asleep:
            raise RuntimeError(f"{WHERE}.generate: the engine is asleep; call wake() first.")
        if self._unset:
            raise RuntimeError(
                f"{WHERE}.generate: {len(self._unset)} weights were never set (built with "
                f"load_weights=False), e.g. {sorted(self._unset)[:3]}; call update_weights "
                "with the whole model first."
            )
        if sampling.stop and self.tokenizer is None:
            raise ValueError(
                f"{WHERE}.generate: stop strings need a tokenizer; build the engine with "
                "tokenizer=... or drop SamplingParams.stop."
            )

    def _check_lengths(self, prompts: list[np.ndarray], limits: np.ndarray, n: int) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(
                    f"{WHERE}.generate: prompt {i} is empty; give every prompt a token."
                )
            longest = len(p) + int(limits[i * n : (i + 1) * n].max())
            if longest > self.max_model_len:
                raise ValueError(
                    f"{WHERE}.generate: prompt {i} has {len(p)} tokens and may generate "
                    f"{longest - len(p)} more, past max_model_len={self.max_model_len}; shorten "
                    "it, lower max_new_tokens, or build the engine with a larger max_model_len."
                )

    def _ensure_graphs(self) -> None:
        if self.use_graphs and self.runner.graphs is None:
            from rayrl.rollout.native.graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner, self.max_num_seqs)
        if self.use_prefill_graphs and self.runner.prefill_graphs is None:
            self.runner.prefill_graphs = PrefillGraphs(
                self.runner, self.prefill_graph_tokens, self.max_num_seqs
            )

    # ------------------------------------------------------------------ weights
    def update_weights(
        self, weights: WeightSource, *, sharded: bool = False, version: int | None = None
    ) -> int:
        """Copy HF-named tensors into the engine's weights in place (converted to its dtype).

        Samples may be in flight: the launched step is committed first, they keep their
        KV caches, and every token drawn afterwards carries ``version`` (when given).

        Tensor-parallel, every rank of the group is updated, each on its own: whole
        tensors are narrowed to the rank's part before the copy; with ``sharded`` the
        tensors are the rank's parts already (`rayrl.rollout.native.tp_weights`).

        Raises:
            KeyError: a name the model does not have (with the closest names it has).
            ValueError: a tensor whose shape differs from the model's.
        """
        self.drain()
        if self.prefix is not None:  # cached blocks hold the old weights' keys and values
            self.prefix.clear()
        if version is not None:
            self.sched.version = int(version)
        seen: list[str] = []
        before = 0 if self.vision is None else self.vision.copied
        pairs = _noting(self._routed(weights, seen), seen)
        copied = self.weights.load(pairs, f"{WHERE}.update_weights", sharded)
        copied += 0 if self.vision is None else self.vision.copied - before
        if self._unset:
            self._unset -= self.weights.filled(seen)
        return copied

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the KV cache (weights stay); `wake` takes it back.

        Where the cache has a fixed address (`KVCache.fixed_address`: CUDA's virtual
        memory), only its pages go, and the CUDA graphs, which hold that address, stay
        with their memory pool, to be replayed after the wake with no capture. Elsewhere
        the graphs go too. Both go by reference count, the moment the engine drops them
        (nothing else holds them, and they hold no cycle), so no garbage collection runs
        here: a full `gc.collect` in a worker that has loaded torch, transformers and Ray
        walks every object it has, which cost most of a small step (docs/benchmarks.md).

        A fixed-address cache's pages go straight back to the device, so torch's cached
        blocks are left alone: in a hybrid worker they are mostly the trainer's, which
        would otherwise allocate them all again at its next step (`wake` empties them
        only if the device is then short of room for the cache's pages). A cache from
        torch's allocator is handed back to the device by emptying that cache."""
        if self._asleep:
            return
        if self.sched.live:
            raise RuntimeError(
                f"{WHERE}.sleep: {self.sched.live} samples are in flight; finish or abort "
                "them before the KV cache is freed"
            )
        self.drain()  # a step launched a step late (its tokens are dropped) is committed
        self._asleep = True
        if self.prefix is not None:
            self.prefix.clear()
        if not self.cache.fixed_address:  # the graphs hold the cache's address
            self.runner.graphs = self.runner.prefill_graphs = None
        self.cache.free()
        if self.device.type == "cuda" and not self.cache.fixed_address:
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Take the KV cache back (graphs dropped at the sleep are captured again by the
        next `generate`)."""
        self.cache.allocate()
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        return self._asleep

    @property
    def weights_unset(self) -> int:
        """Weights no load has filled yet (built with ``load_weights=False``)."""
        return len(self._unset)


def _noting(pairs: Iterable[tuple[str, Tensor]], seen: list[str]) -> Iterator[tuple[str, Tensor]]:
    """``pairs`` as they are, each name noted in ``seen`` as it is taken."""
    for name, tensor in pairs:
        seen.append(name)
        yield name, tensor

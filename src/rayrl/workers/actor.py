"""ActorRolloutRef: one process holding the policy's training engine, its rollout engine
and (optionally) the frozen reference policy — the hybrid engine.

On a CPU, unsharded (one rank), the rollout engine wraps the training model itself:
generation reads the weights the last `update_actor` wrote, with no copy. Otherwise
(sharded over several ranks, fp32 master weights on a GPU, parameters offloaded, or
another rollout engine) the rollout engine keeps its own copy in its dtype (bf16 on a
GPU), refreshed in place before the first generation after an update from weights
streamed in that dtype a bucket at a time (`TrainEngine.rollout_weights`: a sharded
parameter is cast before it is gathered, so no rank ever holds the fp32 state).
The reference policy is bf16 on a GPU (``ref.fsdp_config.model_dtype`` unset, as in
verl); with LoRA it is the same model with its adapters disabled: no second copy. A
mixture-of-experts reference splits its experts over ``ref.expert_parallel_size`` ranks
(the actor's ``expert_parallel_size`` unless set), as the actor does.
``actor.fsdp_config.param_offload`` (``ref.fsdp_config.param_offload``) keeps the
actor's (reference's) weights in host memory between calls, ``optimizer_offload`` the
Adam moments outside the optimizer step.

Generation goes through the rollout service (`rayrl.rollout.service`), as an
asynchronous replica's does: the engine, the one turn loop and, with
``rollout.multi_turn.enable``, episodes of model turns and tool answers
(`rayrl.workers.agent`): the tools are loaded once per worker, each row's environment
is its ``agent_name``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rayrl import progress
from rayrl.algos import expand_advantages
from rayrl.algos.probs_diff import probs_diff_from_totals
from rayrl.batch import Batch
from rayrl.cluster.broadcast import BroadcastMember
from rayrl.config.routing_checks import routing_on
from rayrl.config.schema import RayRLConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.models.loading import with_chat_template
from rayrl.rollout import (
    HFRolloutEngine,
    SamplingParams,
    make_rollout_engine,
    resolve_rollout,
)
from rayrl.rollout.native.tp import make_tp_groups
from rayrl.rollout.native.tp_weights import tp_rollout_weights
from rayrl.rollout.service import RolloutService
from rayrl.train.lora import LoraSpec
from rayrl.train.outputs import IMAGE_COLUMN, MODEL_INPUTS
from rayrl.train.router_replay import routing
from rayrl.train.weight_sync import PublishedWeights
from rayrl.workers import routing as replay
from rayrl.workers.agent import configured_interactions, configured_tools, rollout_service
from rayrl.workers.common import (
    engine_kwargs,
    epoch_rows,
    forward_sizes,
    load_rng,
    logprob_temperature,
    mean_metrics,
    optim_spec,
    per_rank_mini_batch,
    ref_engine_kwargs,
    rng_state,
    sampling_params,
    save_rng,
    set_rng_state,
    update_perf_metrics,
    with_lengths,
)
from rayrl.workers.context import StageResult, StepContext, collect_stage
from rayrl.workers.log_prob_pass import log_prob_columns
from rayrl.workers.losses import actor_loss_fn, distill_spec
from rayrl.workers.weight_transport import check_transport, publish_packed

log = logging.getLogger("rayrl.workers")

# Timed parts of `generate` that lie within the generation's own time (`timing_s/gen`),
# not stages riding along with it: tool calls, CUDA-graph captures, and the engine's
# KV cache reacquired before the generation and released after it.
GEN_PARTS = ("tools", "graph_capture", "rollout_wake", "rollout_sleep")
# The native engine's prefix cache: a call's prompt tokens, and those it found cached
# (`rollout/prefix_cache_hit_rate`)
PREFIX_COUNTS = ("prefix_hit_tokens", "prefix_tokens")


def update_actor_reads(cfg: RayRLConfig) -> tuple[str, ...]:
    """The columns `update_actor` reads under `cfg`: the model's inputs (and the rows'
    images, where prompts have them), advantages and old log-probs (none on-policy),
    the reference's log-probs for a KL loss, the teachers' for distillation, the rollout's (with the batch's normaliser,
    and the mask before rejection) when a rollout correction weighs with them, and the
    routing record a replay mode replays."""
    correction = cfg.algorithm.rollout_correction
    reads = [*MODEL_INPUTS, IMAGE_COLUMN, "advantages", "old_log_probs"]
    reads += replay.routing_reads(cfg)
    if cfg.actor_rollout_ref.actor.use_kl_loss:
        reads.append("ref_log_prob")
    if cfg.distillation.enabled:
        reads.append("teacher_log_prob")
    if correction.bypass_mode or correction.rollout_is is not None:
        reads += ["rollout_log_probs", "rollout_is_norm"]
    elif cfg.actor_rollout_ref.rollout.calculate_log_probs:  # an on-policy update's metrics
        reads.append("rollout_log_probs")
    if correction.rollout_is is not None and correction.rollout_rs is not None:
        reads.append("rollout_is_mask")  # the weights' mask: before rejection (verl's)
    return tuple(reads)


if TYPE_CHECKING:  # the engine loads in the worker (init_worker), not in the driver
    from transformers import PreTrainedTokenizerBase

    from rayrl.rollout.native.engine import NativeRolloutEngine
    from rayrl.train.engine import TrainEngine


class ActorRolloutRefWorker(Worker):
    """Policy training, generation and reference log-probs in one process per bundle."""

    def init_worker(
        self,
        config: RayRLConfig,
        model_path: str,
        *,
        total_steps: int | None = None,
        with_ref: bool = True,
    ) -> None:
        """Build the engines; the group formed the process group (FSDP uses it) already."""
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.cfg = config
        self._broadcast = BroadcastMember()  # rank 0's, for async's collective transport
        arr, seed = config.actor_rollout_ref, config.trainer.seed
        lora = LoraSpec.from_model_config(arr.model)
        self.actor = TrainEngine(
            model_path,
            optim=optim_spec(arr.actor.optim, total_steps),
            total_steps=total_steps,
            lora=lora,
            join=self.joining,  # a replacement: its state comes from the snapshot restore
            freeze_vision_tower=arr.actor.freeze_vision_tower,
            expert_parallel_size=arr.actor.expert_parallel_size,
            **engine_kwargs(
                arr.model,
                arr.actor.fsdp_config,
                seed,
                arr.actor.use_torch_compile and not routing_on(config),  # hooks: eager
                arr.actor.ulysses_sequence_parallel_size,
            ),
        )
        self.lora = lora is not None
        self.ref = None
        if with_ref and not self.lora:
            self.ref = TrainEngine(
                model_path,
                trainable=False,
                weights_from=self.actor,  # the actor's load, not a second read
                join=self.joining,  # a replacement: its own shards, read alone
                **ref_engine_kwargs(arr, seed),
            )
        self.with_ref = with_ref
        self.tokenizer = with_chat_template(
            _load_tokenizer(arr.model.tokenizer_path or model_path, arr.model.trust_remote_code),
            arr.model.custom_chat_template,
        )
        # The engine and its options, resolved once (`auto` -> the engine that runs here).
        self.rollout_choice = resolve_rollout(
            arr.rollout, config.data, self.actor.device.type, self.actor.config
        )
        self.rollout_name = self.rollout_choice.name
        replay.check_recording_engine(config, self.rollout_name)
        self.rollout_dtype, self._owns_copy = _rollout_placement(self.actor, self.rollout_name)
        self.model_path = model_path
        self.tp = self._tensor_parallel_size()
        if self._owns_copy:
            self._build_rollout()
        else:
            self._wrap_rollout()
        self._stale = self._owns_copy
        self.tools = configured_tools(config)  # once per worker (none: single-turn)
        self.interactions = configured_interactions(config)
        self._service: RolloutService | None = None

    @property
    def service(self) -> RolloutService:
        """The rollout service over the current rollout engine (a rebuild may have made
        or wrapped a new one): the engine, the turn loop and, with multi-turn
        rollouts, the episodes (the tools are the worker's, loaded once)."""
        if self._service is None or not self._service.holds(self.rollout):
            self._service = rollout_service(
                self.rollout,
                self.cfg,
                self.tools,
                self.interactions,
                self.tokenizer,
                model_path=self.model_path,
            )
        return self._service

    def _tensor_parallel_size(self) -> int:
        """`rollout.tensor_model_parallel_size` for the native engine (it splits the model
        over that many ranks); the hf engine runs a whole copy per rank and ignores it."""
        tp = self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
        if tp > 1 and self.rollout_name != "native":
            if self.rank == 0:
                log.warning(
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=%d has no effect on "
                    "the %s rollout engine (one whole model per rank); the native engine splits "
                    "the model",
                    tp,
                    self.rollout_name,
                )
            return 1
        if self.world_size % tp:  # asynchronous training: the replicas are split, not us
            if self.rank == 0:
                log.info(
                    "tensor_model_parallel_size=%d splits the rollout replicas; the trainer's "
                    "own %d rank(s) validate with a whole model each",
                    tp,
                    self.world_size,
                )
            return 1
        return tp

    def _build_rollout(self) -> None:
        """The rollout engine with its own copy of the weights; tensor-parallel replicas
        cut from the group's process group (again after it re-forms: the old groups die).
        The engine reads only the model's config and tokenizer: its weights come from
        the training engine's load through the first weight sync (the copy starts
        stale), so the checkpoint is read once."""
        options = dict(self.rollout_choice.options)
        if self.tp > 1:
            self.tp_groups = make_tp_groups(self.world_size, self.tp)
            options.update(self.tp_groups.engine_options)
        dtype = {"dtype": self.rollout_dtype} if self.rollout_name == "hf" else {}
        options["load_weights"] = False  # filled by the first weight sync, not from disk
        self.rollout = make_rollout_engine(
            self.rollout_name,
            model_path=self.model_path,
            tokenizer=self.tokenizer,
            device=str(self.actor.device),
            config_overrides=self.actor.config_overrides,
            **dtype,
            **options,
        )
        if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
            self.rollout.sleep()  # the KV cache is taken only while generating

    @register(dispatch=ONE_TO_ALL)
    def data_parts(self) -> dict[str, int]:
        """This rank's part of each data layout its calls follow (`controller.layout`):
        ranks of a sequence-parallel group share the training rows (`train`, `ref`),
        ranks of a tensor-parallel rollout replica the prompts (`rollout`)."""
        ref = self.ref if self.ref is not None else self.actor
        replica = self.rank // self.tp
        return {"train": self.actor.dp_rank, "ref": ref.dp_rank, "rollout": replica}

    def _wrap_rollout(self) -> None:
        """The rollout engine on the training module itself (the unsharded hybrid). On a
        CPU its KV cache is dynamic: a static one is re-sized for every new prompt
        length, which costs generation time (docs/benchmarks.md)."""
        cache = "static" if self.actor.device.type == "cuda" else "dynamic"
        self.rollout = HFRolloutEngine(
            model=self.actor.model, tokenizer=self.tokenizer, cache=cache
        )
        if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
            self.rollout.sleep()  # the KV cache is taken only while generating

    # ---------------------------------------------------------------- recovery
    def snapshot_state(self) -> dict[str, Any]:
        """The policy's state at a step boundary (the reference is frozen; the rollout's
        copy follows the policy) and this process's RNGs."""
        return {"actor": self.actor.snapshot(reuse=True, wait=False), "rng": rng_state()}

    def snapshot_nbytes(self) -> int:
        """Bytes `snapshot_state` puts in the object store from this rank."""
        return self.actor.snapshot_nbytes()

    def restore_state(self, state: dict[str, Any]) -> None:
        self.actor.restore(state["actor"])
        set_rng_state(state["rng"])
        self._stale = self._owns_copy  # the rollout's copy is refreshed before generating

    def rebuild(self) -> None:
        """After the process group re-formed: policy and reference sharded anew on the
        weights this rank holds (nothing read from storage, `TrainEngine.rebuild`); the
        rollout engine keeps its own copy (refreshed from the restored policy; its
        tensor-parallel groups cut anew) or, when it wraps the training module, wraps
        the new one."""
        self.actor.rebuild()
        if self.ref is not None:
            self.ref.rebuild()
        if self._owns_copy:
            if self.tp > 1:  # the replicas' groups belonged to the old process group
                self._build_rollout()
            self._stale = True
        else:
            self._wrap_rollout()

    # ---------------------------------------------------------------- rollout
    def sampling_params(self, mode: str = "train") -> SamplingParams:
        """Training sampling (`rollout.*`), validation sampling (`rollout.val_kwargs.*`),
        or one greedy response per prompt (ReMax's baseline): `StepContext.sampling`."""
        return sampling_params(self.cfg, mode)

    def _sync_rollout_weights(self) -> float:
        """Stream the updated weights into the rollout's copy (in its dtype, bucketed);
        the seconds it took (0 when the copy was current)."""
        if not self._stale:
            return 0.0
        start = time.perf_counter()
        with self.actor.resident(), progress.phase("weight_sync"):
            if self.tp > 1 and not self.lora:  # each rank receives only its TP part
                native = cast("NativeRolloutEngine", self.rollout)  # TP: native only
                parts = tp_rollout_weights(
                    self.actor.model, self.rollout_dtype, native.spec, self.tp
                )
                native.update_weights(parts, sharded=True)
            else:
                self.rollout.update_weights(self.actor.rollout_weights(self.rollout_dtype))
        if self.actor.device.type == "cuda":
            # this stream's work only: a step snapshot's copies may still run on theirs
            torch.cuda.current_stream(self.actor.device).synchronize()
        self._stale = False
        return time.perf_counter() - start

    @register(dispatch=ONE_TO_ALL, collect="first")
    def publish_weights(
        self, transport: str = "object_store", group: Any = None, key: str = ""
    ) -> PublishedWeights | None:
        """The policy's full weights for rollout replicas in other processes
        (`rollout.mode=async`): in the rollout dtype (bf16 on a GPU, the training dtype
        on a CPU), packed a bucket at a time and put into the object store; with the
        ``collective`` transport also broadcast over `group` (a `BroadcastSpec`) under
        store key `key` (`rayrl.workers.weight_transport`). Every rank takes part in
        the gathers; rank 0 returns the handle, the others None."""
        check_transport(transport, f"actor rank {self.rank}")
        with self.actor.resident(), progress.phase("weight_sync"):
            stream = self.actor.rollout_weights(self.rollout_dtype)
            if self.rank != 0:
                for _ in stream:  # each bucket's gather is a collective
                    pass
                return None
            return publish_packed(stream, self._broadcast, transport, group, key, self.actor.device)

    @register(dispatch=DP_SPLIT, collect=collect_stage, layout="rollout")
    def generate(self, prompts: Batch, ctx: StepContext) -> StageResult:
        """n samples per prompt (interleaved), with rollout log-probs and finish reasons,
        sampled as `ctx.sampling` says; timed stages: `weight_sync` and what rides along
        (`ctx.with_scores`, `ctx.with_ref`). With multi-turn rollouts each sample is an
        episode (`rayrl.rollout.agent.rollout`: its per-sample columns come along)
        and `tools` is the time some environment step ran (within the generation), as
        is `graph_capture`, the native engine's CUDA-graph captures (where it captured),
        and `rollout_wake` / `rollout_sleep`, the engine's KV cache taken and given back.

        With ``rollout.free_cache_engine`` the engine's KV cache is released after each
        generation (verl's semantics) and reacquired before the next.
        """
        timing = {"weight_sync": self._sync_rollout_weights()}
        params = self.sampling_params(ctx.sampling)
        if self.rollout.is_asleep:
            since = time.perf_counter()
            self.rollout.wake()
            timing["rollout_wake"] = time.perf_counter() - since
        service = self.service
        out = service.generate(prompts, params).batch
        if service.episodes is not None:
            timing["tools"] = service.episodes.last_stats["timing_s/tools"]
        stats = getattr(self.rollout, "last_stats", {})
        capture_s = stats.get("graph_capture_s", 0.0)
        if capture_s:  # the native engine's CUDA-graph captures (after each wake)
            timing["graph_capture"] = capture_s
        if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
            since = time.perf_counter()
            self.rollout.sleep()
            timing["rollout_sleep"] = time.perf_counter() - since
        out = with_lengths(self._ride_along(out, ctx, timing))
        counts = {k: float(stats[k]) for k in PREFIX_COUNTS if k in stats}
        return StageResult(out, timing, counts)

    def _ride_along(self, out: Batch, ctx: StepContext, timing: dict[str, float]) -> Batch:
        """`ctx.with_scores` / `ctx.with_ref`: the colocated reward role's scores and the
        reference log-probs of the fresh samples, computed here by the code of the
        separate calls, each timed into ``timing`` (`reward`, `ref`)."""
        stages = []
        if ctx.with_scores:
            reward = getattr(self, "peers", {}).get("reward")
            if reward is None:
                raise RuntimeError(
                    f"actor rank {self.rank}: generate was asked to score its samples "
                    "(StepContext.with_scores) but no reward role runs in this process; "
                    "call the reward group's compute_score instead"
                )
            stages.append(("reward", reward.score))
        if ctx.with_ref:
            stages.append(("ref", self._ref_log_prob))
        for stage, fn in stages:
            start = time.perf_counter()
            out = out.union(fn(out))
            timing[stage] = time.perf_counter() - start
        return out

    # --------------------------------------------------------------- log-probs
    @register(dispatch=DP_SPLIT, layout="train")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the sampled responses (`old_log_probs`) and
        what the pass returns beside them (`rayrl.workers.log_prob_pass`)."""
        arr = self.cfg.actor_rollout_ref
        # Entropy (and sum_pi_squared) come from the same fused chunk pass (no second
        # read of the logits); the trainer reports `actor/entropy`, as verl does.
        with routing(self.actor.model, replay.log_prob_pass(self.cfg, batch)):
            out = self.actor.forward(
                batch,
                with_entropy=True,
                temperature=logprob_temperature(arr.rollout),
                with_sum_pi_squared=arr.actor.calculate_sum_pi_squared,
                **forward_sizes(arr.rollout),
            )
        return log_prob_columns(batch, out)

    @register(dispatch=DP_SPLIT, layout="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """The reference policy's log-probs (`ref_log_prob`): the frozen initial model,
        or with LoRA the same model with its adapters disabled."""
        return self._ref_log_prob(batch)

    def _ref_log_prob(self, batch: Batch) -> Batch:
        sizes = forward_sizes(self.cfg.actor_rollout_ref.ref)
        temperature = logprob_temperature(self.cfg.actor_rollout_ref.rollout)
        if self.lora:
            with self.actor.adapters_disabled():
                out = self.actor.forward(batch, temperature=temperature, **sizes)
        elif self.ref is not None:
            out = self.ref.forward(batch, temperature=temperature, **sizes)
        else:
            raise RuntimeError(
                f"actor rank {self.rank}: compute_ref_log_prob called but the reference "
                "policy is off; set actor_rollout_ref.ref.enable=true"
            )
        return Batch({"ref_log_prob": out["log_probs"]})

    # ------------------------------------------------------------------ update
    @register(dispatch=DP_SPLIT, collect=mean_metrics, layout="train")
    def update_actor(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        """PPO epochs over mini-batches of `ppo_mini_batch_size` x n samples (this rank's
        share of each); one LR-schedule step per call (an RL step). Metrics are each
        mini-batch's value, averaged over mini-batches and epochs.

        With `ctx.on_policy` (`rayrl.trainer.on_policy`: one epoch, one mini-batch) the
        batch has no `old_log_probs`: the loss takes the forward's own, detached, and
        the forward also reports `actor/entropy`."""
        a, n = self.cfg.actor_rollout_ref.actor, self.cfg.actor_rollout_ref.rollout.n
        batch["advantages"] = expand_advantages(batch["advantages"], batch["response_mask"])
        mini = per_rank_mini_batch(a.ppo_mini_batch_size * n, self.actor.dp_size, len(batch))
        if ctx.on_policy and (a.ppo_epochs != 1 or mini < len(batch)):
            raise ValueError(
                f"actor rank {self.rank}: an on-policy update needs one PPO epoch over one "
                f"mini-batch; got {a.ppo_epochs} epoch(s), mini-batches of {mini} of "
                f"{len(batch)} rows: compute old_log_probs with compute_log_prob first"
            )
        if self.actor.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.actor.device)
        start = time.perf_counter()
        with replay.update_routing(self.cfg, batch, self.actor.model, ctx.on_policy) as batch:
            metrics = self._train_epochs(batch, ctx, mini)
        flops = sum(m.pop("flops", 0.0) for m in metrics)
        perf = update_perf_metrics(flops, time.perf_counter() - start, self.actor.device)
        self._stale = self._owns_copy
        out = mean_metrics([metrics], None)
        out.update(probs_diff_from_totals(out))  # on-policy with the rollout's log-probs
        out.update(replay.routing_from_totals(out))  # ... and its routing record
        if a.use_kl_loss:
            out["actor/kl_coef"] = a.kl_loss_coef
        out = {f"actor/{k}" if "/" not in k else k: v for k, v in out.items()}
        for key, value in perf.items():
            out[f"perf/{key}/actor" if key in ("mfu", "tflops") else f"perf/{key}"] = value
        return out

    def _train_epochs(self, batch: Batch, ctx: StepContext, mini: int) -> list[dict[str, float]]:
        """`ppo_epochs` passes of `train_step` over this rank's rows (reshuffled per epoch
        when `actor.shuffle`); each pass's metrics."""
        arr = self.cfg.actor_rollout_ref
        a = arr.actor
        loss_fn = actor_loss_fn(
            a,
            self.cfg.data.max_response_length,
            self.cfg.algorithm.rollout_correction,
            on_policy=ctx.on_policy,
            distill=distill_spec(self.cfg.distillation),
        )
        metrics = []
        for epoch in range(a.ppo_epochs):
            rows = epoch_rows(batch, ctx.step, epoch, a.shuffle, self.cfg.trainer.seed, self.rank)
            metrics.append(
                self.actor.train_step(
                    rows,
                    loss_fn,
                    mini_batch_size=mini,
                    micro_batch_size=None if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu,
                    max_tokens_per_micro_batch=a.ppo_max_token_len_per_gpu
                    if a.use_dynamic_bsz
                    else None,
                    with_entropy=a.entropy_coeff != 0 or ctx.on_policy,
                    step_lr=epoch == a.ppo_epochs - 1,
                    temperature=logprob_temperature(arr.rollout),
                )
            )
        return metrics

    # ------------------------------------------------------------- checkpoints
    @register(dispatch=ONE_TO_ALL)
    def save(self, path: str) -> None:
        """Sharded actor checkpoint under `path/actor`: model, optimizer, LR schedule,
        this rank's RNGs, and (rank 0) what an offline HF export needs."""
        from rayrl.train.hf_export import write_hf_meta

        out = Path(path) / "actor"
        self.actor.save(out)
        save_rng(out, self.rank)
        if self.rank == 0:
            write_hf_meta(self.actor, out)

    @register(dispatch=ONE_TO_ALL)
    def load(self, path: str) -> None:
        """Restore `save`'s checkpoint (any number of ranks wrote it)."""
        out = Path(path) / "actor"
        self.actor.load(out)
        load_rng(out, self.rank)
        self._stale = self._owns_copy

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """An HF model directory at `path` in the training dtype, LoRA merged."""
        self.actor.export_hf(path, dtype=self.actor.training_dtype)

    @register(dispatch=ONE_TO_ALL)
    def device_info(self) -> dict[str, Any]:
        return {
            "device": str(self.actor.device),
            "sharded": self.actor.sharded,
            "pid": os.getpid(),
            "rollout": type(self.rollout).__name__,
            "rollout_asleep": self.rollout.is_asleep,
            "param_offload": self.actor.residency.param_offload,
            "optimizer_offload": self.actor.residency.optimizer_offload,
            "rollout_owns_copy": self._owns_copy,
            "rollout_cache": getattr(self.rollout, "cache", None),  # HF engine's KV cache
            "rollout_dtype": str(self.rollout_dtype).removeprefix("torch."),
            "rollout_weights_unset": getattr(self.rollout, "weights_unset", 0),
        }


def _rollout_placement(actor: TrainEngine, engine: str) -> tuple[torch.dtype, bool]:
    """The rollout's weight dtype (bf16 on a GPU, else the actor's) and whether it needs
    its own copy: always, except an HF rollout on a resident actor not wrapped in FSDP
    whose weights already have that dtype (then it wraps the training module itself)."""
    actor_dtype = next(actor.model.parameters()).dtype
    dtype = torch.bfloat16 if actor.device.type == "cuda" else actor_dtype
    shared = (
        engine == "hf"
        and not actor.fsdp
        and actor_dtype == dtype
        and not (actor.residency.param_offload and actor.device.type == "cuda")
    )
    return dtype, not shared


def _load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

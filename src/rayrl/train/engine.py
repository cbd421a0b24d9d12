"""The training engine: one Hugging Face model, FSDP2-sharded, with its optimizer.

`TrainEngine` is what actor, reference and critic workers hold. It loads a model
directory (a causal LM, or with ``value_head=True`` the same weights under a one-label
token-classification head: the critic), shards it with FSDP2 when torch.distributed
is initialised with several ranks (gloo on CPU, NCCL on GPU), and offers:

* `forward(batch)`: per-token log-probs (and entropy) or values over the response
  columns, without gradients, micro-batch by micro-batch;
* `train_step(batch, loss_fn, ...)`: mini-batches of micro-batches with gradient
  accumulation (sharded: one reduce-scatter per mini-batch), clipping and AdamW; a step
  with a non-finite gradient norm is skipped and the parameters at fault are logged;
  the metrics carry the step's useful FLOPs (`rayrl.models.flops`);
* `rollout_weights(dtype)`: full weights for a rollout engine, streamed in its dtype;
* `offload()` / `onload()`, or the ``param_offload`` / ``optimizer_offload`` policies
  (`rayrl.train.residency`); `save()` / `load()` (sharded), `export_hf()`.

Several ranks are always wrapped in FSDP2. One GPU computes in bf16 under autocast, or,
with ``fsdp=True`` (``fsdp_config.wrap_one_gpu``), in FSDP2 over a one-rank mesh
(``self.fsdp``; ``self.sharded`` stays False): each layer's weights are cast to bf16
once per forward and backward (autocast casts every weight at every use), the fp32
weights stay the optimizer's master copy; which is faster depends on the micro-batch
size (docs/benchmarks.md). ``torch_compile`` compiles layers and head on CUDA
(`rayrl.train.regional_compile`). One process on a CPU stays unwrapped, in fp32.

Packed rows attend per sequence (`rayrl.train.attention`), a causal LM's output head
returns log-probs without materialising logits (`rayrl.train.logprob_head`), and the
loss a `train_step` takes follows `rayrl.train.loss_contract`.

Layout and loading, for models past one GPU:

* the ranks shard the model flat or, with ``fsdp_size`` below the world size, within
  groups and replicated across them (HSDP); ``ulysses_sequence_parallel_size`` ranks
  split each packed row's tokens between them (`rayrl.train.ulysses`) and must get
  the same rows: the engine's ``dp_rank`` / ``dp_size`` say which rows a rank takes
  (`rayrl.train.mesh`). Loss, gradients and metrics do not depend on either split;
* the model is built on the meta device, sharded, and filled from one read of the
  checkpoint by rank 0, handed out as shards a tensor at a time in the dtype it was
  saved in (`rayrl.train.load_once`); ``weights_from`` fills it from another engine's model
  instead (the reference from the actor's load). ``load_report`` says what the start
  read and the peak host memory of a node, ``bytes_read`` what this rank read. LoRA
  models load whole with transformers.

Recovery (`rayrl.train.recovery`): `snapshot()` / `restore()` keep and put
back a step boundary's state; `rebuild()` builds the engine again on a re-formed
process group from the shards this rank holds (nothing is read from storage), and an
engine built with ``join=True`` (a rank that replaces a lost one) reads at most its own
shards (`rayrl.train.build`).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from rayrl import progress
from rayrl.batch import Batch
from rayrl.models.flops import FlopModel
from rayrl.train.attention import attention_for
from rayrl.train.build import ModelBuilding
from rayrl.train.engine_io import EngineIO
from rayrl.train.fsdp import dp_world_size
from rayrl.train.grad_norm import clip_grad_norm
from rayrl.train.loading import pick_device
from rayrl.train.loss_contract import LossFn
from rayrl.train.moe_aux import add_aux_loss
from rayrl.train.optim import (
    OptimSpec,
    build_lr_scheduler,
    build_optimizer,
    warn_nonfinite_gradients,
)
from rayrl.train.outputs import response_outputs, response_width
from rayrl.train.packing import worth_packing
from rayrl.train.rank_sync import (
    LossMetrics,
    Plan,
    check_same_on_all_ranks,
    global_counts,
    micro_batch_plan,
)
from rayrl.train.regional_compile import compile_regions
from rayrl.train.residency import Residency
from rayrl.train.shared_prompts import repeated_prompt_tokens, share_prompts_on
from rayrl.train.ulysses import check_same_rows
from rayrl.train.vision_inputs import VisionModel

__all__ = ["LossFn", "TrainEngine"]


class TrainEngine(ModelBuilding, EngineIO):
    """A (possibly sharded) HF model with AdamW, an LR schedule and micro-batching.

    Args:
        model_path: a Hugging Face model directory.
        value_head: load a one-label token-classification model (a critic) from it.
        dtype: master-weight dtype ("float32"; "auto" means float32).
        attn_implementation: transformers' attention ("sdpa", "eager", ...).
        gradient_checkpointing: recompute activations in the backward pass.
        use_remove_padding: pack each micro-batch's sequences into one row.
        share_prompts: rows of a micro-batch with the same prompt (GRPO's samples of
            one prompt) run it once, packed with their responses
            (`rayrl.train.shared_prompts`); not with sequence parallelism. ``"auto"``:
            on CUDA (one attention kernel for the packed row; on a CPU its segments
            attend one at a time, which costs more than the prompts save).
        optim: `OptimSpec`, or any config object/dict with its fields.
        total_steps: training steps (`train_step` calls), for the cosine schedule.
        mixed_precision: on GPU, bf16 compute with fp32 master weights and reductions.
        device: defaults to the current CUDA device, else CPU.
        seed: seeds the initialisation of a new value head.
        tokenizer_path: tokenizer saved by `export_hf` (default: ``model_path``).
        logit_chunk_size: tokens per chunk of the log-softmax (4096 on CUDA, else 1024).
        trainable: False builds no optimizer and freezes the weights (a reference
            policy): `forward` and `export_hf` work, training and checkpoints do not.
        trust_remote_code: let transformers run the model directory's own code.
        config_overrides: values set on the model's HF config before it is built
            (verl's ``model.override_config``, `rayrl.models.config_overrides`).
        fsdp: wrap the model in FSDP2 on one rank too (on a GPU: bf16 compute weights
            cast once per micro-batch instead of autocast); several ranks always are.
        torch_compile: on CUDA, compile the decoder layers and the log-prob head's
            chunk math (`rayrl.train.regional_compile`); ignored on a CPU.
        ulysses_sequence_parallel_size: ranks that split each packed row's tokens
            (1: off); divides the world and the model's attention heads.
        fsdp_size: ranks per sharding group; -1 all of them, a divisor of the world
            below it shards within groups and replicates across them (HSDP).
        expert_parallel_size: ranks that split a mixture-of-experts model's experts
            (1: off; `rayrl.train.expert_parallel`); divides the world and the experts.
        weights_from: another engine in this process whose model has the same names
            and shapes: its weights are copied (cast to ``dtype``), nothing is read.
            Building a sharded engine, or rebuilding one, is a collective.
        join: this rank replaces a lost one of a group whose other ranks kept their
            weights and `rebuild` (the same collectives as theirs): no collective read;
            a frozen engine reads its own shards, a trainable one (every weight in its
            snapshots and checkpoints) waits for `restore` or `load`, and reads its own
            shards only if something needs the weights before either.
        freeze_vision_tower: a vision-language model's vision tower gets no gradients
            and no optimizer state (verl's ``actor.freeze_vision_tower``).

    Attributes beyond the arguments: ``dp_rank``, ``dp_size`` (the data-parallel rank:
    ranks of one sequence-parallel group share it and need the same rows), ``sp_rank``,
    ``sp_size``, ``mesh`` (`rayrl.train.mesh.TrainMesh`, None unwrapped),
    ``load_report`` (`rayrl.train.load_once.LoadReport`, all ranks) and ``bytes_read``
    (what this rank read from storage for its weights since it was last built or
    rebuilt).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        value_head: bool = False,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        gradient_checkpointing: bool = False,
        use_remove_padding: bool = True,
        share_prompts: bool | str = False,
        optim: Any = None,
        total_steps: int | None = None,
        mixed_precision: bool = True,
        device: str | torch.device | None = None,
        seed: int = 0,
        tokenizer_path: str | os.PathLike[str] | None = None,
        logit_chunk_size: int | None = None,
        trainable: bool = True,
        lora: Any = None,
        trust_remote_code: bool = False,
        param_offload: bool = False,
        optimizer_offload: bool = False,
        fsdp: bool = False,
        torch_compile: bool = False,
        ulysses_sequence_parallel_size: int = 1,
        fsdp_size: int = -1,
        expert_parallel_size: int = 1,
        weights_from: TrainEngine | None = None,
        config_overrides: dict[str, Any] | None = None,
        join: bool = False,
        freeze_vision_tower: bool = False,
    ) -> None:
        self._args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.join = join
        self.trainable = trainable
        self._pending: Callable[[], int] | None = None  # a new rank's deferred own read
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.value_head = value_head
        self.config_overrides = dict(config_overrides or {})
        self.use_remove_padding = use_remove_padding
        self.freeze_vision_tower = freeze_vision_tower
        self.device = pick_device(device)
        self.share_prompts = share_prompts_on(share_prompts, self.device, attn_implementation)
        self.logit_chunk_size = logit_chunk_size or (4096 if self.device.type == "cuda" else 1024)
        self.world_size = dp_world_size()
        self.sharded = self.world_size > 1  # FSDP over one rank would change nothing
        self.fsdp = self.sharded or fsdp
        self.mixed_precision = mixed_precision and self.device.type == "cuda"
        self._build_mesh(ulysses_sequence_parallel_size, fsdp_size, expert_parallel_size)
        packs = use_remove_padding or self.share_prompts or self.sp_size > 1
        attn = attention_for(attn_implementation, packed=packs)
        start = time.perf_counter()
        model, fill = self._build_model(
            value_head,
            dtype,
            attn,
            seed,
            trust_remote_code,
            lora,
            gradient_checkpointing,
            weights_from,
        )
        self._fill(model, fill, param_offload, start)
        # Ulysses' exchanges stay eager: the attention call, with its collectives, outside
        # the compiled layer graph (not run on a GPU yet inside it)
        self.compiled = torch_compile and compile_regions(
            model, self.device, attention_in_graph=self.sp is None
        )
        self.model = model
        # a vision-language model's images (`rayrl.train.vision_inputs`): its rows' prompts
        # differ by their images, so they never share one run of a prompt
        self.vision = VisionModel.of(model, self.sharded)
        self.share_prompts = self.share_prompts and self.vision is None
        self.optim_spec = (
            optim if isinstance(optim, OptimSpec) else OptimSpec.from_config(optim or {})
        )
        if trainable:
            fused = self.device.type == "cuda"
            self.optimizer = build_optimizer(model.parameters(), self.optim_spec, fused=fused)
            self.scheduler = build_lr_scheduler(self.optimizer, self.optim_spec, total_steps)
        else:
            model.requires_grad_(False)
            self.optimizer = self.scheduler = None
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self.train_steps = 0
        if self._kept is not None:  # a rebuild: the optimizer and schedule as they were
            self._kept.fill_optimizer(model, self.optimizer)
            if self.scheduler is not None and self._kept.scheduler is not None:
                self.scheduler.load_state_dict(self._kept.scheduler)
            self._set_counters(self._kept.counters)
        self.flop_model = FlopModel.of(model) if not value_head else None
        self.residency = Residency(
            model,
            self.optimizer,
            self.device,
            param_offload=param_offload,
            optimizer_offload=optimizer_offload,
        )

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        batch: Batch,
        *,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        with_entropy: bool = False,
        temperature: float = 1.0,
        with_sum_pi_squared: bool = False,
    ) -> Batch:
        """Log-probs (``log_probs``, optionally ``entropy`` and ``sum_pi_squared``) or
        ``values``, no gradients.

        ``batch`` holds ``input_ids``, ``attention_mask``, ``responses`` (or only
        ``response_mask``: the responses' width is read) and optionally
        ``position_ids``; ``temperature`` scales the logits (the sampling temperature).
        Returns a Batch of ``[b, R]`` float32 CPU tensors in the input's row order.
        """
        self.residency.require(optimizer=False)
        self._weights_needed()
        if len(batch) == 0:
            raise ValueError("forward got an empty batch; every rank needs rows.")
        if self.sp is not None:
            check_same_rows(batch["input_ids"], self.sp, self.device, "forward")
        plan = micro_batch_plan(
            batch,
            micro_batch_size,
            self._group_budget(max_tokens_per_micro_batch),
            self.sharded,
            self.device,
            self._sharing,
        )
        self.model.eval()
        parts, order = [], []
        with torch.no_grad(), self.residency.resident():
            for rows in plan:
                _, outputs = self._run(
                    batch,
                    rows,
                    with_entropy,
                    temperature=temperature,
                    with_sum_pi_squared=with_sum_pi_squared,
                )
                if rows is not None:
                    parts.append({k: v.cpu() for k, v in outputs.items()})
                    order.extend(rows)
                progress.tick(micro_batches=1)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        tensors = {k: torch.cat([p[k] for p in parts])[inverse] for k in parts[0]}
        return Batch(tensors, meta=dict(batch.meta))

    def _group_budget(self, max_tokens: int | None) -> int | None:
        """A micro-batch's token budget from a per-GPU one: the ranks of a Ulysses group
        split each micro-batch's tokens, so the micro-batch holds ``sp`` times the
        budget (verl's rule for ``*max_token_len_per_gpu``)."""
        return max_tokens * self.sp_size if max_tokens else max_tokens

    # ----------------------------------------------------------------- train
    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        with_entropy: bool = False,
        step_lr: bool = True,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One training step: an optimizer step per mini-batch, then one LR-schedule step.

        Args:
            batch: this rank's rows (model inputs plus whatever ``loss_fn`` reads).
            loss_fn: ``(outputs, micro_batch) -> (loss, metrics)``; see the module
                docstring for how to scale the loss.
            mini_batch_size: rows of this rank per optimizer step (default: all);
                every rank must make the same number of mini-batches.
            micro_batch_size: rows per forward/backward; or instead
            max_tokens_per_micro_batch: a real-token budget per forward/backward and GPU
                (with Ulysses SP a micro-batch holds ``sp_size`` times it, split over
                the group).
            with_entropy: put ``entropy`` in the outputs given to ``loss_fn``.
            step_lr: advance the LR schedule after this call. A caller that makes
                several calls per schedule step (PPO epochs of one RL step) passes
                True on the last only.
            temperature: scales the logits (the sampling temperature).

        Returns:
            ``loss`` (mini-batch loss), ``grad_norm`` (applied steps), ``lr``,
            ``skipped`` (this call), ``skipped_steps`` (total), ``micro_batches``, and
            ``loss_fn``'s metrics (shares summed over micro-batches and ranks, averaged
            over mini-batches).
        """
        self._require_trainable()
        self.residency.require(optimizer=True)
        self._weights_needed()
        if len(batch) == 0:
            raise ValueError("train_step got an empty batch; every rank needs rows.")
        if self.sp is not None:
            check_same_rows(batch["input_ids"], self.sp, self.device, "train_step")
        minis = batch.split(mini_batch_size or len(batch))
        check_same_on_all_ranks(len(minis), "number of mini-batches", self.sharded, self.device)
        self.model.train()
        metrics: dict[str, list[float]] = defaultdict(list)  # the engine's
        loss_metrics: dict[str, list[float]] = defaultdict(list)  # loss_fn's
        lr = self.scheduler.get_last_lr()[0]
        skipped_before = self.skipped_steps
        with self.residency.resident():
            for mini in minis:
                plan = micro_batch_plan(
                    mini,
                    micro_batch_size,
                    self._group_budget(max_tokens_per_micro_batch),
                    self.sharded,
                    self.device,
                    self._sharing,
                )
                values = self._train_mini_batch(
                    mini, plan, loss_fn, with_entropy, loss_metrics, temperature
                )
                for key, value in values.items():
                    metrics[key].append(value)
        if step_lr:
            with warnings.catch_warnings():  # every step skipped is not a misordered call
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
        self.train_steps += 1
        out = {k: sum(v) / len(v) for k, v in loss_metrics.items() if v}
        out.update({k: sum(v) / len(v) for k, v in metrics.items() if v})
        out.setdefault("grad_norm", float("nan"))
        out["lr"] = lr
        out["skipped"] = self.skipped_steps - skipped_before
        out["skipped_steps"] = self.skipped_steps
        out["flops"] = self.train_flops(batch)
        return out

    @property
    def _sharing(self) -> bool:
        """Whether micro-batches run shared prompts once (not with sequence parallelism)."""
        return self.share_prompts and self.sp is None

    def train_flops(self, batch: Batch) -> float:
        """Useful FLOPs this rank computes in one pass of `train_step` over ``batch``
        (`rayrl.models.flops`): real tokens only, the head over response tokens only, a
        prompt shared by rows once where micro-batches share prompts (``share_prompts``,
        never under Ulysses: there every row runs its prompt); with Ulysses, this rank's
        share: the ``sp`` ranks of a group hold the same rows and each runs ``1/sp`` of
        every packed row's tokens and ``heads/sp`` of its attention."""
        if self.flop_model is None:
            return 0.0
        mask = batch["response_mask"] if "response_mask" in batch else None  # noqa: SIM401
        skipped = repeated_prompt_tokens(batch, response_width(batch)) if self._sharing else 0
        group = self.flop_model.batch_train_flops(
            batch["attention_mask"], mask, response_width(batch), skipped
        )
        return group / self.sp_size

    def _train_mini_batch(
        self,
        mini: Batch,
        plan: Plan,
        loss_fn: LossFn,
        with_entropy: bool,
        loss_metrics: dict[str, list[float]],
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Accumulate gradients over ``plan``'s micro-batches, then clip and step.

        Appends ``loss_fn``'s metrics, summed over micro-batches and ranks, to
        ``loss_metrics``; returns the engine's.
        """
        counted = self.sp_rank == 0  # an SP group's ranks hold the same rows
        tokens, seqs = global_counts(mini, self.sharded, self.device, counted)
        summed = LossMetrics(self.device)  # on the device until the mini-batch ends
        for i, rows in enumerate(plan):
            if self.sharded:  # reduce-scatter once, after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(plan) - 1)
            micro, outputs = self._run(
                mini, rows, with_entropy, counts=(tokens, seqs), temperature=temperature
            )
            if rows is None:  # a dummy: same collectives as a real micro-batch, zero gradient
                loss = sum(v.sum() for v in outputs.values()) * 0.0
            else:
                loss, step_metrics = loss_fn(outputs, micro)
                loss = add_aux_loss(loss, step_metrics, outputs, micro, self.config)
                summed.add(loss, step_metrics)
            (loss * self.world_size).backward()
            progress.tick(micro_batches=1)
        totals = summed.reduce(counted, self.sharded)
        for key, value in totals.items():
            if key != "loss":
                loss_metrics[key].append(value)
        values = {"loss": totals["loss"], "micro_batches": float(len(plan))}
        grad_norm = self._clip_and_step()
        if grad_norm is not None:
            values["grad_norm"] = grad_norm
        return values

    def _clip_and_step(self) -> float | None:
        """Clip, then step, unless the gradient norm is not finite (then skip and count)."""
        clip = self.optim_spec.grad_clip or float("inf")
        norm = clip_grad_norm(self.model, clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(norm):
            warn_nonfinite_gradients(self.model, norm, self.skipped_steps + 1)
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return None
        self._snapshot_copies_done()  # a snapshot's copies read the state it changes
        self.residency.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return norm

    # --------------------------------------------------------------- helpers
    def _run(
        self,
        batch: Batch,
        rows: list[int] | None,
        with_entropy: bool,
        *,
        counts: tuple[float, float] | None = None,
        temperature: float = 1.0,
        with_sum_pi_squared: bool = False,
    ) -> tuple[Batch, dict[str, Tensor]]:
        """The micro-batch of ``rows`` (row 0 for a dummy) and its outputs; with
        ``counts`` (training) the micro-batch moves to the device for ``loss_fn``."""
        rows_cpu = batch.index(rows if rows is not None else [0])
        # page-locked and asynchronous: the host goes on packing while the device works
        micro = rows_cpu.to(self.device, non_blocking=True) if counts is not None else rows_cpu
        if counts is not None:
            micro.meta["global_token_count"], micro.meta["global_seq_count"] = counts
            micro.meta["dp_size"] = self.dp_size
        autocast = self.mixed_precision and not self.fsdp
        packed = self.use_remove_padding and worth_packing(batch["attention_mask"], self.device)
        packed = packed or self.sp is not None  # Ulysses splits a packed row
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext():
            outputs = response_outputs(
                self.model,
                rows_cpu,
                packed=packed,
                value_head=self.value_head,
                temperature=float(temperature),
                with_entropy=with_entropy and not self.value_head,
                chunk_size=self.logit_chunk_size,
                device=self.device,
                sp=self.sp,
                share_prompts=self._sharing,
                vision=self.vision,
                aux_loss=counts is not None,
                with_sum_pi_squared=with_sum_pi_squared and not self.value_head,
            )
        return micro, outputs

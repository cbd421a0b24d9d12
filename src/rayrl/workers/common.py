"""Pieces the role workers share: engine arguments (the reference's included) and sampling settings from the
config, metric collection, the per-rank mini-batch size, the actor update's throughput
and memory figures."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import torch

from rayrl.batch import Batch
from rayrl.config.schema import ActorRolloutRefConfig, RayRLConfig, RefConfig, RolloutConfig
from rayrl.rollout.sampling import SamplingParams
from rayrl.train.optim import OptimSpec

# verl's short dtype names -> torch's
if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Config = TypeVar("Config", bound="DataclassInstance")  # a config group `_with` copies

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def engine_kwargs(
    model: Any, fsdp_config: Any, seed: int, torch_compile: bool = False, sp: int = 1
) -> dict[str, Any]:
    """TrainEngine keyword arguments from a model group and its ``fsdp_config``.

    ``fsdp_config.model_dtype`` is the master weights' dtype; ``fsdp_config.dtype``
    bfloat16 turns on mixed precision (bf16 compute on GPU), float32 turns it off;
    ``param_offload`` / ``optimizer_offload`` keep parameters / Adam moments in host
    memory between uses (`rayrl.train.residency`); ``wrap_one_gpu`` wraps a one-rank
    model in FSDP2 too (several ranks always are); ``fsdp_size`` sets the sharding groups
    (HSDP below the world size); ``torch_compile`` (a group's ``use_torch_compile``)
    compiles layers and head on CUDA; ``sp`` is the role's
    ``ulysses_sequence_parallel_size``.
    """
    dtype = DTYPE_NAMES.get(fsdp_config.model_dtype, fsdp_config.model_dtype)
    compute = DTYPE_NAMES.get(fsdp_config.dtype, fsdp_config.dtype)
    return {
        "dtype": dtype,
        "param_offload": bool(getattr(fsdp_config, "param_offload", False)),
        "optimizer_offload": bool(getattr(fsdp_config, "optimizer_offload", False)),
        "fsdp": bool(getattr(fsdp_config, "wrap_one_gpu", False)),
        "fsdp_size": int(getattr(fsdp_config, "fsdp_size", -1)),
        "ulysses_sequence_parallel_size": int(sp),
        "torch_compile": bool(torch_compile),
        "attn_implementation": model.attn_implementation,
        "gradient_checkpointing": model.enable_gradient_checkpointing,
        "use_remove_padding": model.use_remove_padding,
        "share_prompts": getattr(model, "share_prompts", False),
        "mixed_precision": compute == "bfloat16",
        "seed": seed,
        "tokenizer_path": model.tokenizer_path,
        "trust_remote_code": model.trust_remote_code,
        "config_overrides": dict(getattr(model, "override_config", None) or {}),
    }


def with_lengths(samples: Batch) -> Batch:
    """Generated samples with their lengths in columns of their own, one value per row
    (`response_length`: real response tokens, before any later masking;
    `sequence_length`: real tokens of prompt and response), so that the driver can
    balance and report the rows without reading their masks."""
    samples["response_length"] = samples["response_mask"].sum(-1).to(torch.int32)
    samples["sequence_length"] = samples["attention_mask"].sum(-1).to(torch.int32)
    return samples


class ForwardSizes(TypedDict, total=False):
    """`TrainEngine.forward`'s micro-batch keywords: a size, or a token budget."""

    micro_batch_size: int | None
    max_tokens_per_micro_batch: int | None


def forward_sizes(group: RolloutConfig | RefConfig) -> ForwardSizes:
    """Micro-batch size or token budget of a log-prob pass (a `rollout` or `ref` group)."""
    if group.log_prob_use_dynamic_bsz:
        return {"max_tokens_per_micro_batch": group.log_prob_max_token_len_per_gpu}
    return {"micro_batch_size": group.log_prob_micro_batch_size_per_gpu}


def logprob_temperature(rollout: Any) -> float:
    """The temperature the actor and reference compute log-probs at: the rollout's, or 1
    when the rollout decodes greedily (``temperature=0`` or ``do_sample=false``). A greedy
    rollout takes the argmax of the raw logits and records their temperature-1 log-probs
    (`rayrl.rollout.sampling`), as vLLM reports raw log-probs for verl's
    ``temperature=0``; the trainer's log-probs are of the same distribution, not a
    division by zero."""
    greedy = rollout.temperature == 0 or not rollout.do_sample
    return 1.0 if greedy else float(rollout.temperature)


def optim_spec(optim: Any, total_steps: int | None) -> OptimSpec:
    """The engine's optimizer settings from a config's ``optim`` group (verl's names:
    ``lr_scheduler_type`` in `rayrl train`'s groups, ``lr_scheduler`` in `rayrl sft`'s).

    ``lr_warmup_steps`` < 0 means ``lr_warmup_steps_ratio`` x the run's steps.
    """
    warmup = optim.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim.lr_warmup_steps_ratio * (total_steps or 0))
    return OptimSpec(
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        lr_scheduler=getattr(optim, "lr_scheduler_type", None) or optim.lr_scheduler,
        warmup_steps=warmup,
        min_lr_ratio=optim.min_lr_ratio,
        num_cycles=optim.num_cycles,
        grad_clip=optim.clip_grad,
    )


def reference_kwargs(
    model: Any, fsdp_config: Any, seed: int, torch_compile: bool = False, sp: int = 1
) -> dict[str, Any]:
    """TrainEngine keyword arguments of a frozen reference policy (`engine_kwargs`).

    ``model_dtype`` unset (None) means verl's reference default: bf16 weights where
    compute is bf16 (a GPU with mixed precision) — they are only ever used in bf16
    there, and it halves the memory of fp32 weights nothing updates — else fp32.
    """
    explicit = fsdp_config.model_dtype is not None
    dtype = fsdp_config.model_dtype or "fp32"
    kwargs = engine_kwargs(model, _with(fsdp_config, model_dtype=dtype), seed, torch_compile, sp)
    if not explicit and kwargs["mixed_precision"] and torch.cuda.is_available():
        kwargs["dtype"] = "bfloat16"
    kwargs["optimizer_offload"] = False
    return kwargs


def ref_engine_kwargs(arr: ActorRolloutRefConfig, seed: int) -> dict[str, Any]:
    """TrainEngine keyword arguments of the ``actor_rollout_ref`` group's reference
    policy, wherever it runs (in the actor's processes or on workers of its own):
    `reference_kwargs` of ``ref.fsdp_config``, ``ref.use_torch_compile`` and
    ``ref.ulysses_sequence_parallel_size``, and ``ref.expert_parallel_size`` (the actor's
    unless set: a mixture-of-experts reference splits its experts as the actor does)."""
    ref = arr.ref
    kwargs = reference_kwargs(
        arr.model, ref.fsdp_config, seed, ref.use_torch_compile, ref.ulysses_sequence_parallel_size
    )
    kwargs["expert_parallel_size"] = int(ref.expert_parallel_size)
    return kwargs


def _with(config: Config, **changes: Any) -> Config:
    import dataclasses

    return dataclasses.replace(config, **changes)


def update_perf_metrics(flops: float, seconds: float, device: Any) -> dict[str, float]:
    """verl-named throughput figures of an actor (or critic) update on one rank:
    ``perf/tflops`` achieved, ``perf/mfu`` against the device's bf16 peak (GPUs in
    `rayrl.models.flops.PEAK_BF16_FLOPS`; absent on a CPU), peak memory on a GPU."""
    from rayrl.models.flops import peak_flops

    out = {"tflops": flops / max(seconds, 1e-9) / 1e12}
    if getattr(device, "type", None) == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(device))
        if peak:
            out["mfu"] = flops / max(seconds, 1e-9) / peak
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def rng_state() -> dict[str, Any]:
    """Every RNG of this process: Python's, NumPy's, torch's CPU and CUDA generators."""
    import random

    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(path: Any, rank: int) -> None:
    """This process's RNG states to `path/rng/rank<rank>.pt`."""
    import torch

    folder = path / "rng"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / f"rank{rank}.pt")


def load_rng(path: Any, rank: int) -> None:
    """Restore `save_rng`'s file for `rank` when there is one (rank counts may change)."""
    import torch

    file = path / "rng" / f"rank{rank}.pt"
    if file.is_file():
        set_rng_state(torch.load(file, weights_only=False))


def mean_metrics(outputs: list[Any], state: Any) -> dict[str, float]:
    """Collect: per-rank metric dicts (or lists of them) averaged key by key."""
    sums: dict[str, list[float]] = defaultdict(list)
    stack = list(outputs)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                sums[k].append(float(v))
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}


def per_rank_mini_batch(mini_batch_samples: int, world_size: int, local_rows: int) -> int:
    """Rows of one rank per optimizer step; the config validation made it exact."""
    if mini_batch_samples % world_size:
        raise ValueError(
            f"a mini-batch of {mini_batch_samples} samples does not split over {world_size} ranks"
        )
    per_rank = mini_batch_samples // world_size
    if local_rows % per_rank:
        raise ValueError(
            f"this rank got {local_rows} rows, not a whole number of mini-batches of "
            f"{per_rank}; the step's batch must be train_batch_size x rollout.n samples"
        )
    return per_rank


def epoch_rows(batch: Batch, step: int, epoch: int, shuffle: bool, seed: int, rank: int) -> Batch:
    """This rank's rows for one PPO epoch of `step`: as they are, or (``shuffle``)
    permuted by a generator seeded from (seed, step, epoch, rank), so mini-batches differ
    per epoch and a replayed step draws the same ones."""
    if not shuffle:
        return batch
    generator = torch.Generator().manual_seed(hash((seed, step, epoch, rank)) & (2**63 - 1))
    return batch.index(torch.randperm(len(batch), generator=generator).tolist())


def sampling_params(cfg: RayRLConfig, mode: str = "train") -> SamplingParams:
    """How a generate call samples: the training settings (`rollout.*`), validation's
    (`rollout.val_kwargs.*`) or one greedy response per prompt (`StepContext.sampling`)."""
    rollout = cfg.actor_rollout_ref.rollout
    validate = mode == "validate"
    r = rollout.val_kwargs if validate else rollout
    if mode == "greedy":
        return SamplingParams(
            n=1,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            do_sample=False,
            max_new_tokens=cfg.data.max_response_length,
            seed=cfg.trainer.seed,
        )
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),
        max_new_tokens=cfg.data.max_response_length,
        do_sample=r.do_sample and r.temperature > 0,
        ignore_eos=rollout.ignore_eos and not validate,
        seed=cfg.trainer.seed,
    )

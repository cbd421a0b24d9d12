"""RolloutWorker: one rollout replica of asynchronous training (`rollout.mode=async`).

A replica holds a rollout service (`rayrl.rollout.service`: the engine, the one
turn loop and, with multi-turn rollouts, the episodes with the worker's tools) and
nothing else: no optimizer, no reference. A replica of several ranks
(`rollout.tensor_model_parallel_size`, native engine) splits the model over them: its
ranks form a process group, get the same calls one at a time, and run in lockstep
(`rayrl.rollout.native.tp`); rank 0's result is the replica's. It generates with the
newest policy version it holds; new versions arrive beside its calls (`offer_weights`
runs on a thread of its own, so the fetch from the object store overlaps generation)
and are staged in the service, which swaps them in between two engine steps:

- with `ReplicaCall.partial_rollout` the sequences in flight (episodes mid-turn too)
  go on under the new weights, keeping their KV caches, and each token keeps the
  version that sampled it (`ReplicaResult.versions`);
- without, a call keeps its version (the swap waits for it), and a call whose samples
  could no longer be trained once the new version is out (`ReplicaCall.max_lag`) stops
  at the next step and returns `aborted`: the driver re-queues its prompts.

Samples are seeded by (seed, step, sample uid) exactly as the hybrid engine's
(`rayrl.rollout.sampling`), so a replica holding the same weights draws the
same tokens as the synchronous run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
import torch

from rayrl.batch import Batch
from rayrl.cluster.broadcast import BroadcastMember
from rayrl.config.schema import ModelConfig, RayRLConfig
from rayrl.controller import ONE_TO_ALL, Worker, register
from rayrl.controller.worker import CALLS_GROUP, SNAPSHOT_GROUP
from rayrl.models.config_overrides import apply_config_overrides
from rayrl.models.loading import with_chat_template
from rayrl.rollout import HFRolloutEngine, make_rollout_engine, resolve_rollout
from rayrl.rollout.native.tp import make_tp_groups
from rayrl.rollout.service import Aborted, CallPolicy
from rayrl.train.weight_sync import PublishedWeights, unpack_bucket
from rayrl.workers.agent import configured_interactions, configured_tools, rollout_service
from rayrl.workers.common import DTYPE_NAMES, sampling_params
from rayrl.workers.weight_transport import check_transport, receive_packed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ReplicaCall", "ReplicaResult", "RolloutWorker"]


@dataclass(frozen=True)
class ReplicaCall:
    """How one `generate` call of a replica runs.

    Args:
        step: the step the prompts were fed for (seeds the samples, as in sync runs).
        partial_rollout: newer weights arriving mid-call are swapped in between decode
            steps (else the call keeps its version, or aborts: `max_lag`).
        max_lag: the largest version lag a sample may have when it trains; without
            `partial_rollout`, a call whose version is more than this behind a newer
            one that arrived is aborted.
    """

    step: int
    partial_rollout: bool = False
    max_lag: int = 0


@dataclass
class ReplicaResult:
    """What a `generate` call returns: the samples (None when aborted), the policy
    version of each response token ([rows, R], int64), the worker's timings and its
    engine's counters."""

    batch: Batch | None
    versions: torch.Tensor | None
    first_version: int
    last_version: int
    aborted: bool = False
    timing: dict[str, float] = field(default_factory=dict)
    # the engine's counters since it started (its prefix cache's prompt tokens and
    # hits): the manager takes the growth between a replica's results
    counters: dict[str, float] = field(default_factory=dict)


class RolloutWorker(Worker):
    """A rollout engine with its own copy of the policy, updated by version."""

    def init_worker(self, config: RayRLConfig, model_path: str, version: int = 0) -> None:
        """Build the engine (`rollout.name`, resolved as the hybrid engine resolves it)
        from `model_path`, whose weights are policy version `version`."""
        from transformers import AutoConfig

        from rayrl.train.loading import pick_device

        self.cfg = config
        arr = config.actor_rollout_ref
        device = pick_device(None)
        model_config = AutoConfig.from_pretrained(
            model_path, trust_remote_code=arr.model.trust_remote_code
        )
        overrides = dict(arr.model.override_config)
        apply_config_overrides(model_config, overrides, "actor_rollout_ref.model.override_config")
        tokenizer = _tokenizer(arr.model.tokenizer_path or model_path, arr.model)
        choice = resolve_rollout(arr.rollout, config.data, device.type, model_config)
        ranks = self.world_size if self.ctx is not None else 1  # in-process tests: none
        if ranks > 1 and choice.name != "native":
            raise ValueError(
                f"rollout replica {self.group}: actor_rollout_ref.rollout."
                f"tensor_model_parallel_size={ranks} splits a replica's model over "
                f"ranks, which only the native engine does; this replica's engine is "
                f"{choice.name!r} ({choice.reason or 'rollout.name'}). Set "
                "actor_rollout_ref.rollout.name=native (on CPU too, for tests) or "
                "tensor_model_parallel_size=1."
            )
        if choice.name == "hf":
            # the hybrid engine's own setup: the module as the training engine loads it,
            # the dynamic KV cache on a CPU (`ActorRolloutRefWorker._wrap_rollout`)
            cache = "static" if device.type == "cuda" else "dynamic"
            model = self._load_model(model_path, device)
            self.engine = HFRolloutEngine(model=model, tokenizer=tokenizer, cache=cache)
        else:
            options = dict(choice.options)
            if ranks > 1:  # the replica's ranks split the model (lockstep)
                options.update(make_tp_groups(ranks, ranks).engine_options)
            self.engine = make_rollout_engine(
                choice.name,
                model_path=model_path,
                tokenizer=tokenizer,
                device=str(device),
                config_overrides=overrides,
                **options,
            )
        self.engine_name = choice.name
        self.device = device
        self.engine.version = version
        tools, interactions = configured_tools(config), configured_interactions(config)
        self.service = rollout_service(
            self.engine, config, tools, interactions, tokenizer, True, model_path
        )
        self._broadcast = BroadcastMember()  # the collective transport's group, if used

    def _load_model(self, model_path: str, device: torch.device) -> torch.nn.Module:
        """The policy module as the training engine builds it (same loader, attention
        implementation and output head), so its forward computes what the hybrid
        engine's rollout computes on the same weights."""
        from rayrl.train.attention import attention_for
        from rayrl.train.loading import load_hf_model
        from rayrl.train.logprob_head import install_logprob_head

        arr = self.cfg.actor_rollout_ref
        attn = attention_for(arr.model.attn_implementation, packed=arr.model.use_remove_padding)
        model = load_hf_model(
            model_path,
            value_head=False,
            dtype=self._dtype(device),
            attn_implementation=attn,
            seed=self.cfg.trainer.seed,
            trust_remote_code=arr.model.trust_remote_code,
            config_overrides=dict(arr.model.override_config),
        )
        install_logprob_head(model)
        return model.to(device).eval()

    def _dtype(self, device: torch.device) -> str:
        """bf16 on a GPU (the hybrid engine's rollout copy), else the training dtype, so
        that a CPU replica computes what the synchronous run's rollout computes."""
        if device.type == "cuda":
            return "bfloat16"
        name = self.cfg.actor_rollout_ref.actor.fsdp_config.model_dtype
        return DTYPE_NAMES.get(name, name)

    # ------------------------------------------------------------------ weights
    @property
    def version(self) -> int:
        """The policy version the engine's weights are."""
        return self.service.version

    @ray.method(concurrency_group=SNAPSHOT_GROUP)  # type: ignore[untyped-decorator]  # ray is not followed
    def offer_weights(self, version: int, published: PublishedWeights, rank: int = 0) -> int:
        """Fetch policy `version` (the trainer's `publish_weights`) on a thread of its
        own, beside the running call: from the object store, or, for a ``collective``
        offer, as member `rank` of its broadcast group (`weight_transport`). It is
        staged in the service and swapped in where the calls allow (module docstring).
        Returns the bytes it took; raises when a broadcast fails (the trainer offers the
        object store's copy then)."""
        check_transport(published.transport, f"rollout replica {self.group}")
        if published.transport == "collective":
            try:
                buckets = receive_packed(self._broadcast, published, rank, self.device)
            except Exception as err:
                raise RuntimeError(
                    f"rollout replica {self.group} did not receive policy {version} over the "
                    f"broadcast group: {err}"
                ) from err
        else:
            buckets = ray.get(list(published.refs))
        weights = (pair for bucket in buckets for pair in unpack_bucket(bucket))
        self.service.offer(version, weights)  # offers arrive in order: the last one wins
        return sum(b.nbytes for b in buckets)

    # ----------------------------------------------------------------- generate
    @register(dispatch=ONE_TO_ALL, collect="first", concurrency_group=CALLS_GROUP)
    def generate(self, prompts: Batch, call: ReplicaCall) -> ReplicaResult:
        """`rollout.n` samples (or episodes) per prompt under the newest weights (module
        docstring). Several calls run at once (`CALLS_GROUP`): their samples share the
        engine's batch."""
        service = self.service
        swapped = service.swap_s
        first = service.version
        meta = dict(prompts.meta, step=call.step)
        prompts = Batch(prompts.tensors, prompts.non_tensors, meta)
        policy = CallPolicy(
            partial=call.partial_rollout, max_lag=None if call.partial_rollout else call.max_lag
        )
        start = time.perf_counter()
        if service.is_asleep:
            service.wake()
        try:
            out = service.generate(prompts, sampling_params(self.cfg, "train"), policy)
        except Aborted:
            timing = {"gen": time.perf_counter() - start, "weight_sync": service.swap_s - swapped}
            return ReplicaResult(None, None, first, service.version, True, timing, self._counters())
        timing = {"gen": time.perf_counter() - start, "weight_sync": service.swap_s - swapped}
        if service.episodes is not None:
            timing["tools"] = service.episodes.last_stats.get("timing_s/tools", 0.0)
        first, last = out.first_version, out.last_version
        return ReplicaResult(out.batch, out.versions, first, last, False, timing, self._counters())

    def _counters(self) -> dict[str, float]:
        """The engine's prefix-cache counters since it started (none without one)."""
        prefix = getattr(self.engine, "prefix", None)
        if prefix is None:
            return {}
        return {"prefix_hit_tokens": prefix.hit_tokens, "prefix_tokens": prefix.looked_tokens}


def _tokenizer(path: str, model: ModelConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    return with_chat_template(tokenizer, model.custom_chat_template)

"""The PPO/GRPO trainer: its roles and one step, as data flows.

A step: prompts -> actor.generate -> reward.compute_score (concurrently with
actor.compute_log_prob and, when a KL term needs it, compute_ref_log_prob) ->
critic.compute_values (GAE) -> advantages on the controller (`rayrl.trainer.advantage`)
-> critic.update_critic -> actor.update_actor. With DAPO's dynamic sampling the
scores are awaited first and further rounds of prompts are generated until the batch
is full (`rayrl.trainer.dynamic_sampling`); ReMax adds a greedy rollout per prompt as
its baseline. Each stage is timed (`timing_s/<stage>`); metrics use verl's names.
The calls that sample or update (generate, update_critic, update_actor) carry a
`StepContext`: the step, how to sample, what rides along, whether the update is on-policy.
A multi-turn step (`rollout.multi_turn.enable`) adds the episodes' metrics and, before
the updates, the token check of what the actor trains on (`rayrl.trainer.episodes`).

Everything around the steps (resume, checkpoints, validation when due, tracking,
export, step replay, Ctrl-C) is the run's (`rayrl.trainer.run.Run`):

    run = Run(PPOTrainer(cfg)).setup()
    run.fit()
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rayrl.algos.routing import ACTOR_ROUTES
from rayrl.batch import Batch
from rayrl.cluster.pool import ResourcePool
from rayrl.cluster.spec import PoolSpec
from rayrl.config.quantization import with_quantized_correction
from rayrl.config.schema import RayRLConfig
from rayrl.config.validate import critic_enabled, ref_enabled
from rayrl.controller import WorkerGroup
from rayrl.controller.dispatch import Chunks, Outputs, collect_outputs
from rayrl.data.sampler import StepView
from rayrl.models.loading import check_model_path, load_tokenizer
from rayrl.trainer.advantage import (
    AdvantageStage,
    entropy_metric,
    greedy_baselines,
    shape_rewards,
    warn_extreme_scores,
)
from rayrl.trainer.agent_checks import check_agent_setup
from rayrl.trainer.balance import balance_batch, balanced_samples, sequence_lengths
from rayrl.trainer.contract import TrainData
from rayrl.trainer.data import load_datasets, vision_processor
from rayrl.trainer.dynamic_sampling import fill_batch
from rayrl.trainer.episodes import episode_metrics, is_multi_turn, token_check
from rayrl.trainer.generations import generations_dir, write_training_step
from rayrl.trainer.manifest import data_identity, model_identity
from rayrl.trainer.metrics import (
    batch_metrics,
    prefix_cache_metrics,
    rollout_probs_diff,
    rollout_routing,
    timer,
    variance_proxy,
)
from rayrl.trainer.model_dir import model_dir
from rayrl.trainer.names import check_names
from rayrl.trainer.on_policy import separate_pass_reason
from rayrl.trainer.per_sequence import response_lengths
from rayrl.trainer.resources import cluster_node_cpus, pools_from_config
from rayrl.trainer.ride_along import Riding, riding_stages
from rayrl.trainer.roles import GroupEnv, Roles, start_roles
from rayrl.trainer.scoring import SCORE_COLUMNS, RewardErrors, reward_rows, score_columns
from rayrl.trainer.stage_calls import StageCalls
from rayrl.trainer.stages import GroupStage, LocalStage, Stage, only_reads, run_stages, update_stage
from rayrl.trainer.state import Stateful
from rayrl.trainer.step_state import StepState
from rayrl.trainer.teachers import check_teacher_key, check_teachers
from rayrl.trainer.tool_budget import ToolBudget
from rayrl.trainer.validate import Validator
from rayrl.workers.actor import GEN_PARTS, update_actor_reads
from rayrl.workers.context import StageResult, StepContext, collect_stage
from rayrl.workers.critic import UPDATE_CRITIC_READS, VALUES_READS
from rayrl.workers.log_prob_pass import LOG_PROB_READS
from rayrl.workers.ref import REF_LOG_PROB_READS
from rayrl.workers.reward import SCORE_READS, check_reward_source, reward_metrics
from rayrl.workers.teacher import teacher_reads

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rayrl.controller.method import GroupMethod

log = logging.getLogger("rayrl.trainer")


def resolve_model_path(cfg: RayRLConfig) -> str:
    """The configured model directory, or the tiny demo model (built once, then reused)."""
    return model_dir(cfg.actor_rollout_ref.model.path, cfg.trainer.output_dir, cfg.trainer.seed)


class PPOTrainer:
    """PPO-family training (GRPO, GAE-PPO, RLOO, ...) for one config: a `Trainer`
    (`rayrl.trainer.contract`) that `Run` drives.

    `print_fn` receives the trainer's messages.
    """

    kind = "ppo"
    validate_at_end = False  # verl's: the last step validates only when test_freq > 0

    def __init__(self, cfg: RayRLConfig, print_fn: Callable[[str], None] = print) -> None:
        check_names(cfg)
        cfg = with_quantized_correction(cfg, print_fn)
        self.cfg = cfg
        self.print = print_fn
        self.model_path = resolve_model_path(cfg)
        self.use_critic = critic_enabled(cfg)
        self.use_ref = ref_enabled(cfg)
        self.advantage = AdvantageStage(cfg)  # holds the KL controller: checkpointed
        self.data: TrainData | None = None
        self._sampler_step = -1  # the last step a curriculum sampler was updated with
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.roles: Roles | None = None
        self.riding = Riding()  # stages the generate call computes (ride_along)
        self.validator: Validator | None = None
        self._warned_extreme = False
        self.reward_errors = RewardErrors(cfg)  # the run's budget (`reward.max_error_rate`)
        self.tool_budget = ToolBudget(cfg.data.max_response_length)  # tool turns cut short
        t = cfg.trainer  # verl's generation dumps (`rayrl.trainer.generations`)
        self.rollout_data = generations_dir(t.rollout_data_dir, "trainer.rollout_data_dir")
        self.validation_data = generations_dir(t.validation_data_dir, "trainer.validation_data_dir")

    # ------------------------------------------------------------ the contract
    @property
    def data_needs_ray(self) -> bool:
        return self.cfg.data.loader == "ray"

    @property
    def max_ckpt_to_keep(self) -> int | None:
        """A step directory holds the actor and the critic, so the larger of
        `max_actor_ckpt_to_keep` and `max_critic_ckpt_to_keep` (None: all)."""
        t = self.cfg.trainer
        keeps = [t.max_actor_ckpt_to_keep]
        if self.use_critic:
            keeps.append(t.max_critic_ckpt_to_keep)
        kept = [k for k in keeps if k is not None]
        return max(kept) if len(kept) == len(keeps) else None

    @property
    def pg_timeout_s(self) -> float | None:
        return self.cfg.actor_rollout_ref.nccl_timeout

    def preflight(self) -> None:
        """The critic's and the reward model's paths (the actor's: `load_data`, with its
        tokenizer), the user's reward file and function, read, the distillation
        teachers' models and tokenizers checked (`rayrl.trainer.teachers`); the directories of
        `trainer.rollout_data_dir` and `trainer.validation_data_dir` created; with
        multi-turn rollouts the tools, interactions and chat template checked
        (`rayrl.trainer.agent_checks`)."""
        cfg = self.cfg
        if critic_enabled(cfg) and cfg.critic.model.path:
            check_model_path(cfg.critic.model.path, key="critic.model.path")
        if cfg.reward_model.enable and cfg.reward_model.model.path:
            check_model_path(cfg.reward_model.model.path, key="reward_model.model.path")
        check_reward_source(cfg)
        check_teachers(cfg, self._actor_tokenizer())
        if cfg.actor_rollout_ref.rollout.multi_turn.enable:
            check_agent_setup(cfg, self._actor_tokenizer(), self.model_path)
        for directory in (self.rollout_data, self.validation_data):
            if directory is not None:
                directory.prepare()

    def _actor_tokenizer(self) -> PreTrainedTokenizerBase:
        """The actor's tokenizer (its chat template replaced by `custom_chat_template`),
        loaded once."""
        if self.tokenizer is None:
            model = self.cfg.actor_rollout_ref.model
            named = "tokenizer_path" if model.tokenizer_path else "path"
            self.tokenizer = load_tokenizer(
                model.tokenizer_path or self.model_path,
                key=f"actor_rollout_ref.model.{named}",
                trust_remote_code=model.trust_remote_code,
                chat_template=model.custom_chat_template,
            )
        return self.tokenizer

    def load_data(self) -> TrainData:
        """Tokenizer, training prompts and validation prompts (before any reservation)."""
        d = self.cfg.data
        tokenizer = self._actor_tokenizer()
        vision = vision_processor(self.cfg, self.model_path, tokenizer)
        train, val = load_datasets(self.cfg, tokenizer, vision)
        check_teacher_key(self.cfg, train)
        seed = self.cfg.trainer.seed if d.seed is None else d.seed  # verl's data.seed
        self.data = TrainData(train, d.train_batch_size, d.shuffle, val, seed=seed)
        return self.data

    def pool_specs(self, device: str) -> list[PoolSpec]:
        return pools_from_config(self.cfg, device, cluster_node_cpus(device))

    def start(
        self, pools: list[ResourcePool], env: GroupEnv, device: str, total_steps: int
    ) -> list[WorkerGroup]:
        roles = self.roles = start_roles(
            self.cfg,
            env,
            pools,
            device,
            model_path=self.model_path,
            total_steps=total_steps,
            use_ref=self.use_ref,
            use_critic=self.use_critic,
        )
        reward_in_actor = getattr(roles.reward, "group", None) is roles.hybrid
        self.riding = riding_stages(
            self.cfg, roles.hybrid.world_size, reward_in_actor, self.use_ref
        )
        if self.data is not None and self.data.val is not None:
            self.validator = self._validator(self.data.val)
        return roles.groups

    def _validator(self, dataset: Any) -> Validator:
        cfg = self.cfg
        return Validator(
            dataset,
            self._roles().actor.generate,
            self._validation_scores,
            self._tokenizer().batch_decode,
            n=cfg.actor_rollout_ref.rollout.val_kwargs.n,
            batch_size=cfg.data.val_batch_size,
            examples=cfg.trainer.val_examples,
            out_dir=Path(cfg.trainer.output_dir) / "val_generations",
            data_dir=self.validation_data,
        )

    def _validation_scores(self, batch: Batch) -> Batch:
        """The validation samples' scores, counted in the run's reward error budget."""
        scores = self.score(batch)
        self.reward_errors.check(batch.union(score_columns(scores)), self._tokenizer().batch_decode)
        return scores

    def score(self, batch: Batch, calls: StageCalls | None = None, stage: str = "") -> Batch:
        """`batch` scored by the reward group, its rows split by node (`reward_rows`);
        through `calls` (kept for a replayed step) when given."""
        roles = self._roles()
        rows = self._sent(batch)
        if calls is None:
            return cast(Batch, roles.reward.compute_score(rows))
        return cast(Batch, calls.run(stage, roles.reward.compute_score, rows))

    def _sent(self, batch: Batch) -> Batch | Chunks:
        """What the reward group's `compute_score` is sent of `batch`: the columns it
        reads, its rows split by node (`reward_rows`)."""
        roles = self._roles()
        return reward_rows(only_reads(batch, SCORE_READS), roles.hybrid, roles.reward)

    def stateful_groups(self) -> list[WorkerGroup]:
        return [self._roles().hybrid]

    def parts(self) -> dict[str, Stateful]:
        return {"advantage": self.advantage, "reward_errors": self.reward_errors}

    def fingerprint(self) -> dict[str, Any]:
        cfg = self.cfg
        d, arr, alg = cfg.data, cfg.actor_rollout_ref, cfg.algorithm
        return {
            "model": model_identity(self.model_path),
            "train_files": data_identity(d.train_files) or f"synthetic:{d.synthetic_task}",
            "data.train_batch_size": d.train_batch_size,
            "rollout.n": arr.rollout.n,
            "actor.ppo_mini_batch_size": arr.actor.ppo_mini_batch_size,
            "algorithm.adv_estimator": alg.adv_estimator,
            "actor.policy_loss.loss_mode": arr.actor.policy_loss.loss_mode,
            "critic": self.use_critic,
        }

    def save(self, path: Path) -> None:
        roles = self._roles()
        roles.actor.save(str(path))
        if roles.critic is not None:
            roles.critic.save(str(path))

    def load(self, path: Path) -> None:
        roles = self._roles()
        roles.actor.load(str(path))
        if roles.critic is not None:
            roles.critic.load(str(path))

    def validate(self, step: int) -> dict[str, float]:
        if self.validator is None:
            raise RuntimeError("validate() needs validation data (data.val_files)")
        return self.validator.run(step)

    def export(self, path: Path) -> None:
        self._roles().actor.export_hf(str(path))

    def _roles(self) -> Roles:
        if self.roles is None:
            raise RuntimeError("the PPO roles are not started yet: call Run.setup() first")
        return self.roles

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet: call load_data() first")
        return self.tokenizer

    # ------------------------------------------------------------------ a step
    def step(self, prompts: Batch, calls: StageCalls) -> tuple[dict[str, float], list[str]]:
        """One PPO step on a batch of prompts (its `stages`, in order): its metrics and
        the prompt uids it trained."""
        state = StepState.begin(prompts, calls)
        with timer(state.timing, "step"):
            run_stages(self.stages(), state)
        batch, metrics = state.samples, state.metrics
        assert state.lengths is not None  # taken by the adv stage, which every step runs
        metrics.update(batch_metrics(batch, state.lengths.float()))
        metrics.update(variance_proxy(batch, metrics))
        metrics.update({f"timing_s/{k}": v for k, v in state.timing.items()})
        tokens = float(sequence_lengths(batch).sum())
        ranks = self.cfg.trainer.nnodes * self.cfg.trainer.n_gpus_per_node
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / (state.timing["step"] * ranks)  # per GPU, as verl
        self._update_sampler(state.ctx.step, batch)
        if self.rollout_data is not None:  # after the metrics: not in timing_s/step
            decode = self._tokenizer().batch_decode
            metrics.update(write_training_step(self.rollout_data, batch, decode, state.ctx.step))
        return metrics, sorted(set(batch["uid"]))

    def stages(self) -> list[Stage]:
        """The step's stages for this run's config and roles, in order: generate; the
        reward call started beside the log-prob passes (or awaited first by dynamic
        sampling, or ridden along); ReMax's greedy baselines; the old, reference and
        teacher log-probs and the values; the scores collected; advantages (and the
        token check of multi-turn rows); the critic's update, then the actor's."""
        roles, alg = self._roles(), self.cfg.algorithm
        stages: list[Stage] = [LocalStage("gen", self._generate_stage)]
        if alg.filter_groups.enable:  # riding scores exclude filter_groups
            stages.append(
                LocalStage("dynamic_sampling", self._dynamic_sampling, "dynamic_sampling")
            )
        elif self.riding.scores:
            stages.append(LocalStage("scores_ridden", self._ridden_scores))
        else:
            stages.append(LocalStage("reward_start", self._start_scores))
        if alg.adv_estimator == "remax":
            stages.append(LocalStage("gen_baseline", self._baselines, "gen_baseline"))
        stages.append(LocalStage("old_log_prob", self._old_log_probs))
        if self.use_ref and not self.riding.ref:
            ref = self._kept(roles.actor.compute_ref_log_prob)
            stages.append(GroupStage("ref", ref, REF_LOG_PROB_READS))
        if roles.teacher is not None:  # on-policy distillation
            teacher = self._kept(roles.teacher.compute_teacher_log_prob)
            stages.append(GroupStage("teacher", teacher, teacher_reads(self.cfg)))
        if roles.critic is not None:
            values = self._kept(roles.critic.compute_values)
            stages.append(GroupStage("values", values, VALUES_READS))
        if not alg.filter_groups.enable and not self.riding.scores:
            stages.append(LocalStage("reward", self._collect_scores, "reward"))
        stages.append(LocalStage("adv", self._advantages))
        if roles.critic is not None:
            critic = roles.critic.update_critic
            stages.append(update_stage("update_critic", critic, UPDATE_CRITIC_READS))
        actor, reads = roles.actor.update_actor, update_actor_reads(self.cfg)
        learns = lambda state: self.actor_learns(state.ctx.step)  # noqa: E731
        stages.append(update_stage("update_actor", actor, reads, when=learns))
        return stages

    def _generate_stage(self, state: StepState) -> None:
        state.batch = self._generate(
            state.prompts, state.ctx, state.calls, state.timing, state.metrics
        )

    def _start_scores(self, state: StepState) -> None:
        """The reward call, started: it runs beside the log-prob passes."""
        score = self._kept(self._roles().reward.compute_score)
        state.scores = state.calls.start("reward", score, self._sent(state.samples))

    def _collect_scores(self, state: StepState) -> None:
        state.batch = self._scored(state.samples, state.scores.get(), state.metrics)
        state.scores = None

    def _ridden_scores(self, state: StepState) -> None:
        """The generate call scored its samples itself (`trainer.ride_along`)."""
        state.batch = self._scored(state.samples, None, state.metrics)

    def _dynamic_sampling(self, state: StepState) -> None:
        """DAPO: the scores awaited, then further rounds of prompts until the batch is
        full (`rayrl.trainer.dynamic_sampling`)."""
        self._start_scores(state)
        self._collect_scores(state)
        prompts, ctx, calls, metrics = state.prompts, state.ctx, state.calls, state.metrics
        extra = lambda r: self._extra_round(prompts, ctx, r, calls, metrics)  # noqa: E731
        state.batch, sampled = fill_batch(self.cfg, state.samples, extra)
        metrics.update(sampled)

    def _baselines(self, state: StepState) -> None:
        """ReMax: each prompt's greedy response, scored, as its samples' baseline."""
        baselines = self._greedy_baselines(state.prompts, state.ctx, state.samples, state.calls)
        state.samples["reward_baselines"] = baselines

    def _old_log_probs(self, state: StepState) -> None:
        """The old log-probs: the rollout's (`rollout_correction.bypass_mode`), the
        update's own (`rayrl.trainer.on_policy`), or a separate pass of the actor."""
        batch = state.samples
        if self.cfg.algorithm.rollout_correction.bypass_mode:  # verl's: the rollout's serve
            state.timing["old_log_prob"] = 0.0
            batch["old_log_probs"] = batch["rollout_log_probs"].clone()
        elif separate_pass_reason(self.cfg, len(batch)) is None:
            state.timing["old_log_prob"] = 0.0  # the update's own log-probs (trainer.on_policy)
            state.ctx = state.ctx.but(on_policy=True)
        else:
            self._old_pass().run(state)

    def _old_pass(self) -> GroupStage:
        """The actor's pass over the samples: the old log-probs, the optimal token
        baseline's `sum_pi_squared` and R2's routing record, with their metrics."""
        method = self._kept(self._roles().actor.compute_log_prob)
        keep = ("old_log_probs", "sum_pi_squared", ACTOR_ROUTES)
        return GroupStage("old_log_prob", method, LOG_PROB_READS, keep, after=self._old_metrics)

    def _old_metrics(self, old: Batch, batch: Batch) -> dict[str, float]:
        metrics = {**entropy_metric(self.cfg, old, batch), **rollout_routing(old)}
        if self.cfg.actor_rollout_ref.rollout.calculate_log_probs:
            metrics.update(rollout_probs_diff(old, batch))
        return metrics

    def _advantages(self, state: StepState) -> None:
        """Advantages on the controller (`timing_s/adv`), then, for multi-turn rows, the
        token check of what the updates train on."""
        state.lengths = response_lengths(state.samples)  # before rejection masks tokens
        with timer(state.timing, "adv"):
            state.metrics.update(self.advantage(state.samples))
        if is_multi_turn(state.samples):
            state.metrics.update(self._checked_tokens(state.samples))

    def _update_sampler(self, step: int, batch: Batch) -> None:
        """A curriculum sampler (`data.sampler` with ``update``) sees the step's batch, once
        per step: a replayed step does not call it again (`rayrl.data.sampler`)."""
        sampler = getattr(self.data.dataset, "sampler", None) if self.data is not None else None
        update = getattr(sampler, "update", None)
        if update is None or step <= self._sampler_step:
            return
        batch.materialize()  # the sampler reads any column
        update(batch=StepView(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta)))
        self._sampler_step = step

    def _generate(
        self,
        prompts: Batch,
        ctx: StepContext,
        calls: StageCalls,
        timing: dict[str, float],
        metrics: dict[str, Any],
    ) -> Batch:
        """The step's samples (balanced across ranks before and after), with what rides
        on the generate call; `timing_s/gen` excludes the riding stages."""
        roles = self._roles()
        gen_ctx = ctx.but(with_scores=self.riding.scores, with_ref=self.riding.ref)
        with timer(timing, "gen"):
            prompts = self._balanced(prompts, metrics, "gen", self._parts("rollout"))
            generate = self._kept(roles.actor.generate, DRIVER_COLUMNS)
            done = calls.run("gen", generate, prompts, gen_ctx, collect=collect_outputs)
            result = self._balanced_samples(done, metrics)
        during = GEN_PARTS  # parts of the generation's own time
        riding = {k: v for k, v in result.timing.items() if k not in ("weight_sync", *during)}
        timing.update(riding, weight_sync=result.timing.get("weight_sync", 0.0))
        timing.update({k: result.timing[k] for k in during if k in result.timing})
        timing["gen"] -= sum(riding.values())
        metrics.update(prefix_cache_metrics(result.counts))
        if is_multi_turn(result.batch):
            metrics.update(episode_metrics(result.batch))
            self.tool_budget.check(result.batch)  # once per run: tool turns cut short
        return result.batch

    def _balanced_samples(self, done: Outputs, metrics: dict[str, float]) -> StageResult:
        """The generate call's result, its rows balanced over the training ranks as
        `_balanced` does (`trainer.balance_batch`), in the copy that assembles them."""
        if not self.cfg.trainer.balance_batch:
            return collect_stage(done.outputs, done.state)
        result, found = balanced_samples(done, self._parts("train"))
        metrics.update({f"{k}/train": v for k, v in found.items()})
        return result

    def _checked_tokens(self, batch: Batch) -> dict[str, float]:
        """The token check of the rows about to be trained (`rayrl.trainer.episodes`),
        unless `multi_turn.tokenization_sanity_check_mode=disable`; a mismatch is logged."""
        mode = self.cfg.actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode
        if mode == "disable":
            return {}
        checked, first = token_check(batch)
        if first is not None:
            log.warning(
                "rollout/token_mismatch=%d: the tokens trained on differ from the rollout's "
                "record (%s); this is a bug in rayrl, please report it",
                int(checked["rollout/token_mismatch"]),
                first,
            )
        return checked

    def _kept(self, method: GroupMethod, driver: tuple[str, ...] | None = None) -> GroupMethod:
        """`method` (a group method) called so that its result's token columns (or all
        but `driver`) stay with the workers (`trainer.rows_on_workers`,
        `rayrl.controller.kept`)."""
        return method.keeping(driver) if self.cfg.trainer.rows_on_workers else method

    def actor_learns(self, step: int) -> bool:
        """False during the critic's warm-up (`trainer.critic_warmup` first steps)."""
        return step >= self.cfg.trainer.critic_warmup

    def _parts(self, layout: str) -> int:
        """How many chunks a call following data layout `layout` splits its rows into: the
        data-parallel groups (sequence-parallel groups or rollout replicas share one)."""
        found = self._roles().hybrid.data_layout(layout)
        return found.parts if found is not None else self._roles().hybrid.world_size

    def _balanced(self, batch: Batch, metrics: dict[str, float], stage: str, parts: int) -> Batch:
        """`trainer.balance_batch`: rows reordered so each data-parallel part's chunk holds
        about the same number of tokens (prompts before generation, whole sequences
        after it), with the imbalance (heaviest part / mean) before and after."""
        t = self.cfg.trainer
        if not t.balance_batch:
            return batch
        batch, found = balance_batch(batch, parts)
        metrics.update({f"{k}/{stage}": v for k, v in found.items()})
        return batch

    def _scored(self, batch: Batch, scores: Batch | None, metrics: dict[str, float]) -> Batch:
        """`batch` with its scores (overlong penalty added); failed scorings logged. The
        reward metrics (`reward/score/mean`, ...) of the first scoring in a step are
        kept: they cover every sample of the step's prompts, before any filtering.
        `scores` None: `batch` carries them already (`trainer.ride_along`). The samples
        count in the run's reward error budget (`RewardErrors`: it may stop the run)."""
        if scores is not None:
            batch = batch.union(score_columns(scores))
        self.reward_errors.check(batch, self._tokenizer().batch_decode)
        for key, value in reward_metrics(batch).items():
            metrics.setdefault(key, value)
        if not self._warned_extreme:  # once a run: the reward's scale is the user's to fix
            self._warned_extreme = warn_extreme_scores(batch["scores"], self.print)
        metrics.update(shape_rewards(self.cfg, batch))
        errors = [e for e in batch["reward_error"] if e is not None]
        if errors:
            log.warning(
                "reward: %d of %d samples failed to score and count 0 (first: %s)",
                len(errors),
                len(batch),
                errors[0],
            )
        return batch

    def _greedy_baselines(
        self, prompts: Batch, ctx: StepContext, batch: Batch, calls: StageCalls
    ) -> torch.Tensor:
        """ReMax: each prompt's greedy response, scored, as its samples' baseline."""
        roles = self._roles()
        greedy = calls.run("gen_greedy", roles.actor.generate, prompts, ctx.but(sampling="greedy"))
        scored = greedy.batch.union(score_columns(self.score(greedy.batch, calls, "reward_greedy")))
        self.reward_errors.check(scored, self._tokenizer().batch_decode)
        return greedy_baselines(batch, scored)

    def _extra_round(
        self,
        prompts: Batch,
        ctx: StepContext,
        round_: int,
        calls: StageCalls,
        metrics: dict[str, Any],
    ) -> Batch:
        """Dynamic sampling: fresh prompts (seeded by run seed, step and round),
        generated and scored; their uids carry the round so groups never merge."""
        roles, d = self._roles(), self.cfg.data
        if self.data is None:
            raise RuntimeError("the trainer's data is not loaded yet: call load_data() first")
        dataset = self.data.dataset
        size = min(d.gen_batch_size or d.train_batch_size, len(dataset))
        rng = random.Random(f"{self.cfg.trainer.seed}:extra:{ctx.step}:{round_}")
        fresh = dataset.collate(rng.sample(range(len(dataset)), size))
        fresh["uid"] = np.array([f"{u}@{round_}" for u in fresh["uid"]], dtype=object)
        fresh.meta.update(prompts.meta)
        batch = calls.run("gen_extra", roles.actor.generate, fresh, ctx).batch
        return self._scored(batch, self.score(batch, calls, "reward_extra"), metrics)


# The columns of the generated samples the controller reads (the others stay with the
# workers that generated them under `trainer.rows_on_workers`; one read elsewhere is
# fetched): prompt groups, finish reasons and lengths, the scores a generate call
# computed itself (`ride_along`), and the episodes' counts.
DRIVER_COLUMNS = (
    "uid",
    "finish_reason",
    "response_length",
    "sequence_length",
    *(column for column in SCORE_COLUMNS if column != "token_level_scores"),
    "num_turns",
    "tool_stats",
    "multi_turn_events",
)

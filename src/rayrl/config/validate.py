"""Cross-field rules of a config, checked before any resource is reserved.

The batch-size chain of a step (verl's semantics): `data.train_batch_size` prompts,
each sampled `rollout.n` times; the samples split into mini-batches of
`ppo_mini_batch_size` prompts (x n samples), each mini-batch splits evenly over the
data-parallel ranks, and each rank's share splits into micro-batches of
`ppo_micro_batch_size_per_gpu` samples. Every message carries the actual numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayrl.config.async_checks import check_async
from rayrl.config.async_training import WEIGHT_TRANSPORTS
from rayrl.config.distill_checks import check_distillation
from rayrl.config.errors import ConfigError
from rayrl.config.errors import warn as _warn
from rayrl.config.expert_checks import check_expert_parallel
from rayrl.config.layout import MeshError, MeshSpec, check_heads
from rayrl.config.multi_turn import check_multi_turn
from rayrl.config.profiler_checks import check_profiler
from rayrl.config.quantization import QUANTIZATIONS, check_quantization
from rayrl.config.ranges import check_ranges
from rayrl.config.reward_checks import check_judge_pool, check_sandbox_fusion
from rayrl.config.routing_checks import ROUTER_REPLAY_MODES, check_router_replay
from rayrl.config.schema import RayRLConfig, RolloutCorrectionConfig
from rayrl.config.vision_checks import check_vision_language

ACTOR = "actor_rollout_ref.actor"

MODEL_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")
COMPUTE_DTYPES = ("bfloat16", "bf16", "float32", "fp32")
CHOICES = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.resume_check": ("strict", "warn"),
    "data.truncation": ("error", "left", "right"),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": MODEL_DTYPES,
    "actor_rollout_ref.actor.fsdp_config.dtype": COMPUTE_DTYPES,
    "actor_rollout_ref.ref.fsdp_config.model_dtype": (None, *MODEL_DTYPES),
    "actor_rollout_ref.ref.fsdp_config.dtype": COMPUTE_DTYPES,
    "critic.model.fsdp_config.model_dtype": MODEL_DTYPES,
    "critic.model.fsdp_config.dtype": COMPUTE_DTYPES,
    "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "reinforce"),
    "reward_model.score_transform": ("none", "clip", "tanh"),
    "trainer.debugger": ("vscode", "cli"),
    "actor_rollout_ref.rollout.mode": ("sync", "async"),
    "actor_rollout_ref.rollout.quantization": QUANTIZATIONS,
    "async_training.weight_transport": WEIGHT_TRANSPORTS,
    "actor_rollout_ref.actor.router_replay.mode": ROUTER_REPLAY_MODES,
}


def _get(cfg: RayRLConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# What a value that is not a choice means, where rayrl can say more than "not one of".
CHOICE_NOTES: dict[tuple[str, object], str] = {
    ("trainer.device", "npu"): "rayrl runs on NVIDIA GPUs (cuda) and CPUs; Ascend NPUs are "
    "not supported",
    ("trainer.device", "xpu"): "rayrl runs on NVIDIA GPUs (cuda) and CPUs; Intel XPUs are "
    "not supported",
    ("async_training.weight_transport", "nccl"): "the collective transport picks NCCL "
    "itself on GPUs (gloo on CPUs): set collective",
    ("async_training.weight_transport", "gloo"): "the collective transport picks gloo "
    "itself on CPUs (NCCL on GPUs): set collective",
}


def check_choice(path: str, value: object, allowed: tuple[object, ...]) -> None:
    """ConfigError naming the key, the value and the choices, unless `value` is one."""
    if value in allowed:
        return
    names = ", ".join(str(a) for a in allowed)
    note = CHOICE_NOTES.get((path, value))
    raise ConfigError(f"{path}={value!r} is not one of {names}" + (f": {note}" if note else ""))


def check_choices(cfg: RayRLConfig) -> None:
    for path, allowed in CHOICES.items():
        check_choice(path, _get(cfg, path), allowed)


def check_run_keys(cfg: RayRLConfig) -> None:
    """Checkpoint, resume and validation keys of the trainer group (tracker names are
    checked with the other registry names, `rayrl.trainer.names`)."""
    t = cfg.trainer
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path (a "
            "checkpoints/global_step_N directory)"
        )
    if t.step_snapshots not in (True, False, "auto"):
        raise ConfigError(f"trainer.step_snapshots={t.step_snapshots!r}: use true, false or auto")
    share = cfg.actor_rollout_ref.model.share_prompts
    if share not in (True, False, "auto"):
        raise ConfigError(
            f"actor_rollout_ref.model.share_prompts={share!r}: use true, false or auto"
        )
    if cfg.data.loader == "ray" and cfg.algorithm.filter_groups.enable:
        raise ConfigError(
            "algorithm.filter_groups (dynamic sampling) draws extra prompts at random, which "
            "the streaming data.loader=ray cannot; use data.loader=default with it"
        )
    custom = cfg.data.custom_cls
    if custom.path is not None and not custom.name:
        raise ConfigError(f"data.custom_cls.path={custom.path!r} needs data.custom_cls.name")
    if custom.path is not None and cfg.data.loader == "ray":
        raise ConfigError(
            "data.custom_cls (a dataset class of one's own) builds its rows in the driver; "
            "the streaming data.loader=ray reads parquet files itself: use data.loader=default"
        )
    if custom.path is not None and not cfg.data.train_files:
        raise ConfigError("data.custom_cls needs data.train_files (the files given to the class)")


def check_numeric(cfg: RayRLConfig) -> None:
    """Every numeric key in its range (`rayrl.config.ranges`), and the CPUs per worker."""
    check_ranges(cfg)
    check_cpus_per_worker(cfg.resources.cpus_per_worker)


def check_cpus_per_worker(value: object) -> None:
    """`resources.cpus_per_worker` is `auto` or a whole number of CPUs, at least 1."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1:
        raise ConfigError(
            f"resources.cpus_per_worker={value!r} must be auto or a number of CPUs >= 1"
        )


def check_micro_set(cfg: RayRLConfig) -> None:
    """Each forward/backward needs a micro-batch size or a token budget (as in verl)."""
    arr = cfg.actor_rollout_ref
    rules = [
        (
            f"{ACTOR}.ppo_micro_batch_size_per_gpu",
            arr.actor.ppo_micro_batch_size_per_gpu,
            f"{ACTOR}.use_dynamic_bsz",
            arr.actor.use_dynamic_bsz,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            arr.rollout.log_prob_micro_batch_size_per_gpu,
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            arr.rollout.log_prob_use_dynamic_bsz,
        ),
    ]
    if ref_enabled(cfg):
        rules.append(
            (
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                arr.ref.log_prob_micro_batch_size_per_gpu,
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                arr.ref.log_prob_use_dynamic_bsz,
            )
        )
    if critic_enabled(cfg):
        c = cfg.critic
        rules.append(
            (
                "critic.ppo_micro_batch_size_per_gpu",
                c.ppo_micro_batch_size_per_gpu,
                "critic.use_dynamic_bsz",
                c.use_dynamic_bsz,
            )
        )
    for micro_key, micro, dynamic_key, dynamic in rules:
        if micro is None and not dynamic:
            by_tokens = f" or set {dynamic_key}=true to size them by tokens" if dynamic_key else ""
            raise ConfigError(
                f"{micro_key} is not set; set it (samples per forward pass on one GPU){by_tokens}"
            )


def check_batch_chain(
    role: str, prompts: int, n: int, mini: int, micro: int | None, world: int, dynamic: bool
) -> None:
    """Prompts x n samples -> mini-batches -> ranks -> micro-batches, each split exact."""
    if prompts % mini:
        raise ConfigError(
            f"data.train_batch_size={prompts} prompts do not split into mini-batches of "
            f"{role}.ppo_mini_batch_size={mini} prompts ({prompts} % {mini} = {prompts % mini}); "
            f"use a ppo_mini_batch_size that divides {prompts}"
        )
    samples = mini * n
    if samples % world:
        raise ConfigError(
            f"a mini-batch of {mini} prompts x rollout.n={n} = {samples} samples does not "
            f"split over {world} data-parallel ranks (trainer.nnodes x trainer.n_gpus_per_node "
            "/ ulysses_sequence_parallel_size); "
            f"{samples} % {world} = {samples % world}"
        )
    per_rank = samples // world
    if not dynamic and micro is not None and per_rank % micro:
        raise ConfigError(
            f"each rank's share of a mini-batch, {samples} samples / {world} ranks = {per_rank}, "
            f"does not split into micro-batches of {role}.ppo_micro_batch_size_per_gpu={micro} "
            f"({per_rank} % {micro} = {per_rank % micro}); use a micro-batch size dividing {per_rank} "
            f"or set {role}.use_dynamic_bsz=true"
        )


def check_rollout(cfg: RayRLConfig, warn: Callable[[str], None] = _warn) -> None:
    """The native engine's memory share, length limit and tensor-parallel size fit; a
    tensor-parallel size the hf engine would ignore is said."""
    r, data = cfg.actor_rollout_ref.rollout, cfg.data
    tp, per_node = r.tensor_model_parallel_size, cfg.trainer.n_gpus_per_node
    whole_nodes = tp > per_node and tp % per_node == 0 and cfg.world_size % tp == 0
    # with a rollout pool the replicas are split (`config.async_training` checks them);
    # the trainer's own engine (validation) splits only where its ranks allow
    if tp < 1 or (per_node % tp and not whole_nodes and not cfg.asynchronous):
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must be at least 1 and "
            f"divide trainer.n_gpus_per_node={per_node} (replicas of {tp} GPUs of one node), "
            f"or be a multiple of it that divides the rollout's {cfg.world_size} ranks "
            f"(replicas of whole nodes, as verl's); use a divisor of {per_node}"
        )
    if tp > 1 and r.name == "hf":
        warn(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} has no effect with "
            "rollout.name=hf: the hf engine has no tensor parallelism (each rank holds the "
            f"whole model); rollout.name=native splits the model over {tp} ranks"
        )
    longest = data.max_prompt_length + data.max_response_length
    if r.max_model_len is not None and r.max_model_len < longest:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_model_len={r.max_model_len} is shorter than "
            f"data.max_prompt_length + data.max_response_length = {longest}; raise it or leave "
            "it unset (null) to use that sum"
        )


def check_fsdp_size(key: str, size: int, world: int) -> None:
    """`fsdp_size` (the `fsdp_config` group `key` names) is -1, at least the world
    (sharding over every rank), or a divisor of the world (HSDP: `MeshSpec`)."""
    try:
        MeshSpec(world, 1, size)
    except MeshError as err:
        raise ConfigError(str(err).replace("fsdp_config.fsdp_size", key)) from None


def model_heads(path: str | None) -> tuple[int, int] | None:
    """(attention heads, key/value heads) from a local model directory's config.json, or
    None when there is none to read (the engine checks again when it loads)."""
    import json
    import os

    file = os.path.join(path, "config.json") if path else ""
    if not file or not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
        heads = int(config["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return heads, int(config.get("num_key_value_heads") or heads)


def parallel_roles(cfg: RayRLConfig) -> list[tuple[str, int, int, str, bool, str | None]]:
    """Per training role: (key prefix, Ulysses size, fsdp_size, its fsdp_config key,
    packing on, model path)."""
    arr = cfg.actor_rollout_ref
    path, packed = arr.model.path, arr.model.use_remove_padding
    roles = [
        (
            ACTOR,
            arr.actor.ulysses_sequence_parallel_size,
            arr.actor.fsdp_config.fsdp_size,
            f"{ACTOR}.fsdp_config",
            packed,
            path,
        ),
    ]
    if ref_enabled(cfg):
        ref = arr.ref
        roles.append(
            (
                "actor_rollout_ref.ref",
                ref.ulysses_sequence_parallel_size,
                ref.fsdp_config.fsdp_size,
                "actor_rollout_ref.ref.fsdp_config",
                packed,
                path,
            )
        )
    if critic_enabled(cfg):
        c = cfg.critic
        roles.append(
            (
                "critic",
                c.ulysses_sequence_parallel_size,
                c.model.fsdp_config.fsdp_size,
                "critic.model.fsdp_config",
                c.model.use_remove_padding,
                c.model.path or path,
            )
        )
    return roles


def check_sampler(cfg: RayRLConfig) -> None:
    """`data.sampler` names a class (path and name) and orders the in-memory loader's rows."""
    d = cfg.data
    if not d.sampler.class_path and not d.sampler.class_name:
        return
    if not d.sampler.class_path or not d.sampler.class_name:
        raise ConfigError(
            f"data.sampler.class_path={d.sampler.class_path!r} and class_name="
            f"{d.sampler.class_name!r}: a sampler class needs both (a Python file or "
            "pkg://module, and the class's name in it)"
        )
    if d.loader != "default":
        raise ConfigError(
            f"data.sampler orders the rows of the in-memory loader; data.loader={d.loader!r} "
            "streams them in its own order: set data.loader=default or drop data.sampler"
        )


def check_lora(cfg: RayRLConfig) -> None:
    """`model.lora_alpha` is > 0 when LoRA is on (`lora_rank` > 0); with LoRA off it is
    not read, so verl's scripts that set both to 0 load."""
    model = cfg.actor_rollout_ref.model
    if model.lora_rank > 0 and model.lora_alpha <= 0:
        raise ConfigError(
            f"actor_rollout_ref.model.lora_alpha={model.lora_alpha} with lora_rank="
            f"{model.lora_rank}: LoRA's scale would be 0 and the adapters would change "
            "nothing; use a value > 0 (verl's default 16)"
        )


def check_parallel(cfg: RayRLConfig) -> None:
    """Each role's Ulysses size and sharding-group size fit the world, its packing and
    its model's attention heads."""
    for role, sp, fsdp_size, fsdp_key, packed, path in parallel_roles(cfg):
        model = "critic.model" if role == "critic" else "actor_rollout_ref.model"
        check_role_parallel(
            cfg.world_size,
            f"{role}.ulysses_sequence_parallel_size",
            sp,
            f"{fsdp_key}.fsdp_size",
            fsdp_size,
            f"{model}.use_remove_padding",
            packed,
            path,
        )


def check_role_parallel(
    world: int,
    sp_key: str,
    sp: int,
    fsdp_key: str,
    fsdp_size: int,
    packing_key: str,
    packed: bool,
    path: str | None,
) -> None:
    """ConfigError, naming the keys, unless a role's Ulysses size (`sp_key`) and
    sharding-group size (`fsdp_key`) fit the world, its packing and its model's heads."""
    try:
        MeshSpec(world, sp, fsdp_size)
    except MeshError as err:
        text = str(err).replace("ulysses_sequence_parallel_size", sp_key)
        raise ConfigError(text.replace("fsdp_config.fsdp_size", fsdp_key)) from None
    if sp > 1 and not packed:
        raise ConfigError(f"{sp_key}={sp} splits packed rows between ranks; set {packing_key}=true")
    heads = model_heads(path) if sp > 1 and path else None
    if heads is not None:
        assert path is not None  # model_heads ran on it
        try:
            check_heads(*heads, sp, path)
        except MeshError as err:
            text = str(err)
            raise ConfigError(text.replace("ulysses_sequence_parallel_size", sp_key, 1)) from None


def critic_enabled(cfg: RayRLConfig) -> bool:
    """`critic.enable`, or when unset: whether the advantage estimator needs values."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def ref_enabled(cfg: RayRLConfig) -> bool:
    """`actor_rollout_ref.ref.enable`, or when unset: whether a KL term needs it."""
    ref = cfg.actor_rollout_ref.ref
    if ref.enable is not None:
        return ref.enable
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


GROUP_ESTIMATORS = ("grpo", "rloo", "dr_grpo", "gpg", "optimal_token_baseline")


def check_new_algorithms(cfg: RayRLConfig, warn: Callable[[str], None] = _warn) -> None:
    """The optimal token baseline's inputs, SAPO's temperatures, PF-PPO's estimator."""
    alg, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if alg.adv_estimator == "optimal_token_baseline" and not actor.calculate_sum_pi_squared:
        raise ConfigError(
            "algorithm.adv_estimator=optimal_token_baseline reads each token's sum of squared "
            "probabilities over the vocabulary, which the log-prob pass returns only when "
            f"asked: set {ACTOR}.calculate_sum_pi_squared=true (verl requires it too)"
        )
    if actor.calculate_sum_pi_squared and alg.rollout_correction.bypass_mode:
        raise ConfigError(
            f"{ACTOR}.calculate_sum_pi_squared=true needs the log-prob pass, which "
            "algorithm.rollout_correction.bypass_mode=true skips (the rollout's log-probs "
            "serve as the old ones); turn bypass_mode off"
        )
    if actor.policy_loss.loss_mode == "sapo" and min(actor.tau_pos, actor.tau_neg) <= 0:
        raise ConfigError(
            f"{ACTOR}.tau_pos={actor.tau_pos} and {ACTOR}.tau_neg={actor.tau_neg} are SAPO's "
            "gate temperatures and must be > 0 (verl's defaults: 1.0 and 1.05)"
        )
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        warn(
            f"algorithm.use_pf_ppo=true has no effect with algorithm.adv_estimator="
            f"{alg.adv_estimator}: PF-PPO resamples the batch after GAE advantages only, as in verl"
        )


def check_algorithm(cfg: RayRLConfig, n: int, warn: Callable[[str], None] = _warn) -> None:
    alg = cfg.algorithm
    check_new_algorithms(cfg, warn)
    if alg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        warn(
            f"algorithm.adv_estimator={alg.adv_estimator} compares the samples of one "
            f"prompt, but actor_rollout_ref.rollout.n={n}: each group holds one sample, whose "
            "advantage is then its own score (no baseline), as in verl; set rollout.n to 2 or "
            "more for group-relative advantages"
        )
    if alg.kl_ctrl.type == "adaptive" and not alg.use_kl_in_reward:
        raise ConfigError(
            f"algorithm.kl_ctrl.type={alg.kl_ctrl.type} steers the KL penalty in the reward, "
            "which is off; set algorithm.use_kl_in_reward=true (the KL loss uses the fixed "
            "actor_rollout_ref.actor.kl_loss_coef)"
        )
    if alg.adv_estimator == "remax" and alg.filter_groups.enable:
        raise ConfigError(
            "algorithm.filter_groups (dynamic sampling) works with group "
            "estimators such as grpo, not remax"
        )
    if alg.filter_groups.enable:
        if not alg.filter_groups.metric:
            raise ConfigError(
                "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric "
                "(score, seq_reward, or a reward extra such as acc)"
            )
        gen = cfg.data.gen_batch_size
        if gen is not None and gen < cfg.data.train_batch_size:
            raise ConfigError(
                f"data.gen_batch_size={gen} is below data.train_batch_size="
                f"{cfg.data.train_batch_size}; a generation round draws at least a batch"
            )
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= buffer.max_resp_len:
        raise ConfigError(
            f"reward_model.overlong_buffer.len={buffer.len} must be in (0, "
            f"reward_model.overlong_buffer.max_resp_len={buffer.max_resp_len}] (the length "
            "limit the penalty counts back from; default data.max_response_length)"
        )
    rollout = cfg.actor_rollout_ref.rollout
    rc = alg.rollout_correction
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        raise ConfigError(
            "algorithm.rollout_correction.rollout_is_batch_normalize=true normalises the "
            "importance weights, which are off (rollout_is is null); set rollout_is to token "
            "or sequence, or drop rollout_is_batch_normalize"
        )
    if rc.bypass_mode and not rollout.calculate_log_probs:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the "
            "old ones, which actor_rollout_ref.rollout.calculate_log_probs=false drops; set it "
            "to true"
        )
    if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        warn(
            f"algorithm.rollout_correction.loss_type={rc.loss_type} has no effect without "
            "bypass_mode=true (as in verl): the actor's loss is "
            "actor_rollout_ref.actor.policy_loss.loss_mode"
        )
    if alg.rollout_correction.rollout_is is not None and not rollout.calculate_log_probs:
        raise ConfigError(
            f"algorithm.rollout_correction.rollout_is={alg.rollout_correction.rollout_is} "
            "weights samples by the rollout's log-probs, which "
            "actor_rollout_ref.rollout.calculate_log_probs=false drops; set it to true"
        )
    check_rejection_keys(rc, rollout.calculate_log_probs, warn)
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError("reward_model.enable=true needs reward_model.model.path")


def check_rejection_keys(
    rc: RolloutCorrectionConfig, calculate_log_probs: bool, warn: Callable[[str], None]
) -> None:
    """`rollout_rs` reads the rollout's log-probs; a threshold without it does nothing.
    (The options and thresholds themselves are checked with the registry names,
    `rayrl.trainer.names`.)"""
    key = "algorithm.rollout_correction"
    if rc.rollout_rs is not None and not calculate_log_probs:
        raise ConfigError(
            f"{key}.rollout_rs={rc.rollout_rs} rejects tokens by their rollout log-probs, "
            "which actor_rollout_ref.rollout.calculate_log_probs=false drops; set it to true"
        )
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        warn(
            f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold} has no effect: rollout "
            f"rejection sampling is off ({key}.rollout_rs is null)"
        )


def validate_config(cfg: RayRLConfig, warn: Callable[[str], None] = _warn) -> None:
    """Raise ConfigError for the first rule the config breaks; ``warn`` gets one line per
    setting that has no effect (default: a `ConfigWarning`)."""
    check_choices(cfg)
    check_async(cfg, warn)
    check_numeric(cfg)
    check_micro_set(cfg)
    check_rollout(cfg, warn)
    check_quantization(cfg)
    check_multi_turn(cfg.actor_rollout_ref.rollout.multi_turn)
    check_run_keys(cfg)
    check_lora(cfg)
    check_sampler(cfg)
    check_parallel(cfg)
    check_vision_language(cfg, critic_enabled(cfg))
    check_expert_parallel(cfg)
    check_router_replay(cfg, warn)
    check_sandbox_fusion(cfg, warn)
    check_judge_pool(cfg)
    check_profiler(cfg, warn)
    check_distillation(cfg)
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    prompts, world = cfg.data.train_batch_size, cfg.world_size
    check_batch_chain(
        ACTOR,
        prompts,
        n,
        actor.ppo_mini_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        world // actor.ulysses_sequence_parallel_size,
        actor.use_dynamic_bsz,
    )
    if critic_enabled(cfg):
        critic = cfg.critic
        check_batch_chain(
            "critic",
            prompts,
            n,
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
            world // critic.ulysses_sequence_parallel_size,
            critic.use_dynamic_bsz,
        )
    check_algorithm(cfg, n, warn)

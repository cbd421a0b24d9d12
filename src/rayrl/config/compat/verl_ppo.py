"""verl's `main_ppo` keys outside rayrl's schema (`rayrl train`), each with its rule.

The keys are those of verl 0.9.1's `_generated_ppo_trainer.yaml`, plus older names
that verl's example scripts still use. Every key of that file is either a schema key
or has a rule here (`tests/test_config_verl_keys.py` checks each one, set alone to
verl's default). The rule kinds are in `rayrl.config.compat.rules`.
"""

from __future__ import annotations

from dataclasses import fields

from rayrl.config.compat.rules import Inert, Moved, Only, Rule
from rayrl.config.judge import JudgeRolloutConfig
from rayrl.config.profiler import VERL_ROLE_GROUPS

ARR = "actor_rollout_ref"

# -- reasons shared by several keys ---------------------------------------------------
NO_TP = "rayrl's rollout has tensor parallelism only (tensor_model_parallel_size)"
SP_ROLE = (
    "rayrl reads the role's own ulysses_sequence_parallel_size (actor, ref, critic), "
    "not the fsdp_config copy"
)
VLLM = "a vLLM/SGLang engine setting; rayrl's rollout engines do not use it"
ROLE_PROFILER = (
    "rayrl traces with torch.profiler only, with the tool and save_path of global_profiler "
    "and no schedule within a step"
)
SEEDED = "every random draw is seeded from trainer.seed, the step and the sample id"
ENGINE = "an FSDP1/verl-engine tuning knob; rayrl's FSDP2 engine has no such setting"
CHUNKED = "rayrl computes log-probs and entropy from the hidden states in chunks, always"
CKPT = "checkpoints always hold the model, optimizer and trainer state"
TURBO = "verl's fsdp_turbo engine settings; rayrl's FSDP2 engine does not use them"
FOLLOWS_N = "rayrl takes it from actor_rollout_ref.rollout.n"
MTP = "multi-token prediction"
QAT = "quantization-aware training"
MEGATRON_LORA = (
    "Megatron's LoRA settings; rayrl's LoRA is actor_rollout_ref.model.lora_rank, "
    "lora_alpha and target_modules"
)
JUDGE_ENGINE = (
    "a vLLM/SGLang setting of the judge's engine; rayrl's judge engine takes "
    "reward_model.rollout's name, dtype, gpu_memory_utilization, tensor_model_parallel_size, "
    "max_num_seqs, prompt_length, response_length, temperature, top_k, top_p, do_sample, "
    "seed and free_cache_engine"
)

TOPK = (
    "a setting of forward_kl_topk, which rayrl refuses (its engines return no top-k log-probs yet)"
)
DEPRECATED = "verl deprecated this name"
RUN_DIR = (
    "the run directory, which holds config, metrics and checkpoints/global_step_N "
    "(verl writes global_step_N directly under it)"
)

STRATEGY = Only(
    ("fsdp", "fsdp2"),
    "Megatron-LM training",
    note="rayrl always shards with FSDP2",
    hint="rayrl trains with FSDP2 (set strategy=fsdp or fsdp2)",
)


def _fsdp_config(group: str) -> dict[str, Rule]:
    """The rules of an `fsdp_config` group (actor, ref, critic) beyond rayrl's keys."""
    return {
        f"{group}.wrap_policy": Inert("rayrl wraps each decoder layer"),
        f"{group}.offload_policy": Inert(
            "offload is param_offload / optimizer_offload in rayrl's FSDP2 engine"
        ),
        f"{group}.reshard_after_forward": Inert(ENGINE),
        f"{group}.forward_prefetch": Inert(ENGINE),
        f"{group}.use_orig_params": Inert(ENGINE),
        f"{group}.seed": Inert(SEEDED),
        f"{group}.full_determinism": Inert("rayrl's CPU runs are bitwise reproducible anyway"),
        f"{group}.ulysses_sequence_parallel_size": Inert(SP_ROLE),
        f"{group}.entropy_from_logits_with_chunking": Inert(CHUNKED),
        f"{group}.entropy_from_logits_chunk_size": Inert(CHUNKED),
        f"{group}.entropy_checkpointing": Inert(CHUNKED),
        f"{group}.use_torch_compile": Inert(
            "compilation is actor_rollout_ref.actor.use_torch_compile (and ref.use_torch_compile)"
        ),
        f"{group}.use_no_sync_for_gradient_accumulation": Inert(ENGINE),
        f"{group}.pad_to_length": Inert(ENGINE),
        f"{group}.pad_to_length_bucket": Inert(ENGINE),
        f"{group}.forward_only": Inert("rayrl knows which roles train"),
        f"{group}.strategy": STRATEGY,
        f"{group}.optimizer_offload": Inert("the reference model has no optimizer"),
        f"{group}.qat": Inert(QAT + " settings (off)"),
        f"{group}.qat.enable": Only((False,), QAT),
        f"{group}.turbo_config": Inert(TURBO),
        f"{group}.mixed_precision": Inert(
            "FSDP1's mixed-precision dict: rayrl computes in fsdp_config.dtype with master "
            "weights in fsdp_config.model_dtype and reduces gradients in float32"
        ),
    }


def _optim(group: str) -> dict[str, Rule]:
    return {
        f"{group}.optimizer": Only(("AdamW", "adamw"), "optimizers other than AdamW"),
        f"{group}.optimizer_impl": Only(("torch.optim",), "optimizers outside torch.optim"),
        f"{group}.total_training_steps": Inert(
            "the trainer sets it from trainer.total_training_steps or total_epochs"
        ),
        f"{group}.zero_indexed_step": Inert("rayrl's schedules count RL steps from 0"),
        f"{group}.warmup_style": Moved(
            f"{group}.lr_scheduler_type", unset=(None,), note=DEPRECATED
        ),
        f"{group}.grad_clip": Moved(f"{group}.clip_grad", unset=(None,), note=DEPRECATED),
        f"{group}.override_optimizer_config": Only((None, {}), "optimizer constructor overrides"),
    }


def _model(group: str) -> dict[str, Rule]:
    """An HF model group (actor_rollout_ref.model, critic.model)."""
    return {
        f"{group}.hf_config_path": Only((None,), "a model config from another path"),
        f"{group}.use_shm": Inert("models load from their directory as they are"),
        f"{group}.custom_chat_template": Only((None,), "custom chat templates"),
        f"{group}.external_lib": Only(
            (None,), "importing a model library", hint="import it in your reward or model module"
        ),
        f"{group}.enable_activation_offload": Inert("rayrl has no activation offload"),
        f"{group}.exclude_modules": Only((None,), "LoRA exclude_modules"),
        f"{group}.use_liger": Inert("rayrl does not use Liger kernels"),
        f"{group}.use_fused_kernels": Inert(CHUNKED),
        f"{group}.fused_kernel_options": Inert(CHUNKED),
        f"{group}.tiled_mlp": Inert("rayrl has no tiled MLP"),
        f"{group}.tiled_mlp.enabled": Only((False,), "tiled MLP computation"),
        f"{group}.mtp": Inert(MTP + " settings (off)"),
        f"{group}.mtp.enable": Only((False,), MTP),
        f"{group}.lora": Inert(MEGATRON_LORA),
        f"{group}.lora.rank": Only((0,), "Megatron LoRA (model.lora.*)", hint=MEGATRON_LORA),
    }


def _role_common(group: str) -> dict[str, Rule]:
    """Keys that the actor, the reference and the critic all carry."""
    return {
        f"{group}.rollout_n": Inert(FOLLOWS_N),
        f"{group}.strategy": STRATEGY,
        f"{group}.megatron": Only((None, {}), "Megatron-LM training", hint=STRATEGY.hint),
        f"{group}.entropy_from_logits_with_chunking": Inert(CHUNKED),
        f"{group}.entropy_from_logits_chunk_size": Inert(CHUNKED),
        f"{group}.entropy_checkpointing": Inert(CHUNKED),
        f"{group}.pad_to_length": Inert(ENGINE),
        f"{group}.checkpoint": Inert(CKPT),
        f"{group}.data_loader_seed": Inert(SEEDED),
        f"{group}.loss_scale_factor": Only((None,), "a loss scale factor"),
    }


ACTOR: dict[str, Rule] = {
    **_role_common(f"{ARR}.actor"),
    **_fsdp_config(f"{ARR}.actor.fsdp_config"),
    **_optim(f"{ARR}.actor.optim"),
    f"{ARR}.actor.grad_clip": Moved(f"{ARR}.actor.optim.clip_grad"),
    f"{ARR}.actor.megatron.router_replay.mode": Moved(f"{ARR}.actor.router_replay.mode"),
    f"{ARR}.actor.calculate_entropy": Inert("rayrl reports actor/entropy whenever it computes it"),
    # verl's PrefixGrouper runs a group's shared prompt once in the actor's forward:
    # rayrl's shared-prompt training does the same (`rayrl.train.shared_prompts`)
    f"{ARR}.actor.use_prefix_grouper": Moved(
        f"{ARR}.model.share_prompts",
        unset=(False,),
        note="each prompt runs once for its n samples in the training and log-prob passes",
    ),
    f"{ARR}.actor.use_fused_kernels": Inert(CHUNKED),
    f"{ARR}.actor.use_remove_padding": Inert(
        "packing follows actor_rollout_ref.model.use_remove_padding"
    ),
    f"{ARR}.actor.qat": Inert(QAT + " settings (off)"),
    f"{ARR}.actor.qat.enable": Only((False,), QAT),
    f"{ARR}.actor.use_rollout_log_probs": Only((False,), "training on the rollout's log-probs"),
    # settings of losses rayrl does not have (a loss that reads them is picked by
    # policy_loss.loss_mode)
    f"{ARR}.actor.policy_loss.clip_cov_ratio": Inert("a setting of verl's clip_cov loss"),
    f"{ARR}.actor.policy_loss.clip_cov_lb": Inert("a setting of verl's clip_cov loss"),
    f"{ARR}.actor.policy_loss.clip_cov_ub": Inert("a setting of verl's clip_cov loss"),
    f"{ARR}.actor.policy_loss.kl_cov_ratio": Inert("a setting of verl's kl_cov loss"),
    f"{ARR}.actor.policy_loss.ppo_kl_coef": Inert("a setting of verl's ppo_kl loss"),
    f"{ARR}.actor.policy_loss.dro_beta": Inert("a setting of verl's DRO loss"),
}

REF: dict[str, Rule] = {
    **_role_common(f"{ARR}.ref"),
    **_fsdp_config(f"{ARR}.ref.fsdp_config"),
}

ROLLOUT: dict[str, Rule] = {
    f"{ARR}.rollout.data_parallel_size": Inert(NO_TP),
    f"{ARR}.rollout.expert_parallel_size": Inert(NO_TP),
    f"{ARR}.rollout.pipeline_model_parallel_size": Inert(NO_TP),
    f"{ARR}.rollout.load_format": Inert("rollout weights come from the training engine"),
    f"{ARR}.rollout.layered_summon": Inert("rollout weights come from the training engine"),
    f"{ARR}.rollout.nnodes": Inert("the rollout runs on the actor's GPUs (hybrid engine)"),
    f"{ARR}.rollout.n_gpus_per_node": Inert("the rollout runs on the actor's GPUs (hybrid engine)"),
    f"{ARR}.rollout.multi_turn.use_inference_chat_template": Only(
        (False,),
        "re-rendering each multi-turn chat for training",
        hint="rayrl always trains on the exact tokens the rollout sampled and appended",
    ),
    f"{ARR}.rollout.multi_turn.num_repeat_rollouts": Only(
        (None,),
        "repeated rollouts of one sample (verl's CollabLLM recipe)",
        hint="samples per prompt are actor_rollout_ref.rollout.n",
    ),
    f"{ARR}.rollout.enable_chunked_prefill": Inert("the native engine always prefills in chunks"),
    f"{ARR}.rollout.engine_kwargs": Inert(VLLM),
    f"{ARR}.rollout.full_determinism": Inert("rayrl's rollouts are seeded per sample anyway"),
    f"{ARR}.rollout.seed": Inert(SEEDED),
    f"{ARR}.rollout.prompt_length": Moved("data.max_prompt_length"),
    f"{ARR}.rollout.response_length": Moved("data.max_response_length"),
    f"{ARR}.rollout.dtype": Only(
        ("bfloat16", "bf16"),
        "rollouts in float16 or float32",
        note="the native engine runs bf16 on a GPU; the hf engine runs the model's dtype",
    ),
    f"{ARR}.rollout.cudagraph_capture_sizes": Inert(
        "the native engine captures a CUDA graph per batch bucket on first use"
    ),
    f"{ARR}.rollout.logprobs_mode": Only(
        ("processed_logprobs",),
        "rollout log-probs of the raw logits",
        hint="rayrl's are of the sampling distribution (temperature, top-k, top-p applied)",
    ),
    f"{ARR}.rollout.scheduling_policy": Inert(VLLM),
    # verl's SGLang HTTP server settings (its rollout config's `server`), and the older
    # switch to that server, which verl 0.9.1 reads no more
    f"{ARR}.rollout.server": Inert(VLLM),
    f"{ARR}.rollout.sglang_rollout_mode": Inert(
        "verl's old switch to an SGLang HTTP server (verl 0.9.1 does not read it either); "
        "rayrl's rollout engines run inside its workers"
    ),
    f"{ARR}.rollout.disable_log_stats": Inert(VLLM),
    f"{ARR}.rollout.skip_tokenizer_init": Inert(VLLM),
    f"{ARR}.rollout.multi_stage_wake_up": Inert(VLLM),
    f"{ARR}.rollout.over_sample_rate": Inert(
        "rayrl waits for every sample of a step (no slow rollout is aborted)"
    ),
    f"{ARR}.rollout.router_config_path": Inert("rayrl routes no requests between replicas"),
    f"{ARR}.rollout.agent": Inert(
        "rayrl's episodes run in each actor's rollout (no agent-loop workers or servers)"
    ),
    f"{ARR}.rollout.agent.agent_loop_config_path": Only((None,), "agent loop configs"),
    f"{ARR}.rollout.agent.custom_async_server.path": Only((None,), "custom rollout servers"),
    f"{ARR}.rollout.checkpoint_engine": Inert(
        "weights reach the rollout through rayrl's bucketed bf16 sync"
    ),
    f"{ARR}.rollout.trace": Inert("rayrl has no rollout tracing backends"),
    f"{ARR}.rollout.moe_load_balance_metrics_interval": Inert("rayrl reports no MoE metrics"),
    f"{ARR}.rollout.prometheus": Inert("rayrl exports no Prometheus metrics of the rollout"),
    f"{ARR}.rollout.prometheus.enable": Only((False,), "Prometheus metrics of the rollout"),
    f"{ARR}.rollout.quantization_config_file": Only(
        (None,), "quantization config files", hint="rollout.quantization=fp8 needs none"
    ),
    f"{ARR}.rollout.mtp": Inert(MTP + " settings (off)"),
    f"{ARR}.rollout.mtp.enable": Only((False,), MTP),
    f"{ARR}.rollout.qat": Inert(QAT + " settings (off)"),
    f"{ARR}.rollout.qat.enable": Only((False,), QAT),
    f"{ARR}.rollout.disaggregation": Inert("prefill/decode disaggregation settings (off)"),
    f"{ARR}.rollout.disaggregation.enabled": Only((False,), "prefill/decode disaggregation"),
    f"{ARR}.rollout.limit_images": Inert(
        VLLM + " (vLLM's cap on images per prompt; the hf engine takes a row's every image)"
    ),
}

MODEL: dict[str, Rule] = {
    **_model(f"{ARR}.model"),
    f"{ARR}.model.lora_adapter_path": Inert(
        "rayrl does not load saved adapters: LoRA starts from fresh adapters"
    ),
    f"{ARR}.hybrid_engine": Inert("rayrl always runs actor, rollout and reference in one process"),
    # Not in verl's config (verl reads no such key); an example script still sets it.
    f"{ARR}.model.torch_dtype": Inert(
        "verl's config has no such key and verl never reads it; rayrl's dtypes are "
        "actor.fsdp_config.model_dtype (master weights) and fsdp_config.dtype (compute), "
        "and the rollout's weights are bf16 on a GPU"
    ),
}

DATA: dict[str, Rule] = {
    "data.tokenizer": Inert(
        "the tokenizer is the model's (actor_rollout_ref.model.tokenizer_path)"
    ),
    "data.use_shm": Inert("data files are read where they are"),
    "data.train_max_samples": Only((-1,), "a cap on the training rows", hint="cut the file"),
    "data.val_max_samples": Only((-1,), "a cap on the validation rows", hint="cut the file"),
    "data.reward_fn_key": Only(
        ("data_source",), "choosing the reward function by another column than data_source"
    ),
    "data.tool_config_path": Inert(
        "prompts show the tools of actor_rollout_ref.rollout.multi_turn (tool_config_path)"
    ),
    "data.function_tool_path": Inert(
        "prompts show the tools of actor_rollout_ref.rollout.multi_turn (function_tool_path)"
    ),
    "data.return_raw_input_ids": Inert("rayrl keeps what each stage needs"),
    "data.return_raw_chat": Inert("rayrl always keeps the raw chat messages (raw_prompt)"),
    "data.return_full_prompt": Inert("rayrl keeps what each stage needs"),
    "data.image_patch_size": Inert(
        "images are resized on the image processor's own grid (patch_size x merge_size "
        "of the model's preprocessor_config.json)"
    ),
    "data.audio_key": Inert("rayrl reads no audio"),
    "data.return_multi_modal_inputs": Inert(
        "each row of a batch with images carries its multi_modal_inputs"
    ),
    "data.validation_shuffle": Inert("validation runs over every prompt, in file order"),
    "data.filter_overlong_prompts_workers": Inert("prompts are filtered as they are tokenised"),
    "data.trust_remote_code": Inert(
        "the tokenizer follows actor_rollout_ref.model.trust_remote_code"
    ),
}

CRITIC: dict[str, Rule] = {
    **_role_common("critic"),
    **_fsdp_config("critic.model.fsdp_config"),
    **_optim("critic.optim"),
    **_model("critic.model"),
    "critic.fsdp": Moved("critic.model.fsdp_config"),
    "critic.grad_clip": Moved("critic.optim.clip_grad"),
    "critic.model.lora_rank": Only((0,), "LoRA for the critic"),
    "critic.model.lora_alpha": Inert("the critic has no LoRA (critic.model.lora_rank is 0)"),
    "critic.model.target_modules": Inert("the critic has no LoRA (critic.model.lora_rank is 0)"),
    "critic.model.lora_adapter_path": Only((None,), "LoRA for the critic"),
}

REWARD: dict[str, Rule] = {
    # verl 0.9.1's reward section and the older top-level groups are one setting each.
    "reward.custom_reward_function": Moved("custom_reward_function"),
    "custom_reward_function.name": Moved("custom_reward_function.name", unset=(None,)),
    "reward.reward_model.enable": Moved("reward_model.enable"),
    "reward.reward_model.model_path": Moved("reward_model.model.path"),
    "reward.reward_model.enable_resource_pool": Moved("reward_model.enable_resource_pool"),
    "reward.reward_model.n_gpus_per_node": Moved("reward_model.n_gpus_per_node"),
    "reward.reward_model.nnodes": Moved("reward_model.nnodes"),
    "reward.reward_model.rollout": Moved("reward_model.rollout"),
    "reward.reward_kwargs.overlong_buffer_cfg": Moved("reward_model.overlong_buffer"),
    "reward.reward_kwargs.max_resp_len": Moved("reward_model.overlong_buffer.max_resp_len"),
    "reward.reward_manager.source": Only(
        ("register",),
        "reward manager classes of your own",
        hint="write a compute_score (custom_reward_function) or a batched one "
        "(reward.reward_manager.name=batch)",
    ),
    "reward.reward_manager.module": Inert(
        "a custom reward manager module (reward.reward_manager.source is register)"
    ),
    "sandbox_fusion": Moved("reward.sandbox_fusion", unset=(None,)),
    "sandbox_fusion.url": Moved("reward.sandbox_fusion.url", unset=(None,)),
    "sandbox_fusion.max_concurrent": Moved("reward.sandbox_fusion.max_concurrent", unset=(None,)),
    "sandbox_fusion.memory_limit_mb": Moved("reward.sandbox_fusion.memory_limit_mb", unset=(None,)),
    # verl's legacy reward_model.* keys (null: not set) and what they became in 0.9.1
    "reward_model.enable": Moved("reward_model.enable", unset=(None,)),
    "reward_model.num_workers": Moved("reward.num_workers", unset=(None,)),
    "reward_model.reward_manager": Moved("reward.reward_manager.name", unset=(None,)),
    "reward_model.reward_loop_source": Moved("reward.reward_manager.source", unset=(None,)),
    "reward_model.reward_loop_module_path": Moved(
        "reward.reward_manager.module.path", unset=(None,)
    ),
    "reward_model.reward_loop_class_name": Moved(
        "reward.reward_manager.module.name", unset=(None,)
    ),
    "reward_model.enable_resource_pool": Moved("reward_model.enable_resource_pool", unset=(None,)),
    "reward_model.n_gpus_per_node": Moved("reward_model.n_gpus_per_node", unset=(None,)),
    "reward_model.nnodes": Moved("reward_model.nnodes", unset=(None,)),
    "reward_model.reward_kwargs": Moved("reward.reward_kwargs"),
    "reward_model.rollout": Inert(JUDGE_ENGINE),
    # verl's legacy reward_model.rollout.* (null: not set) on the keys the judge takes
    **{
        f"reward_model.rollout.{f.name}": Moved(f"reward_model.rollout.{f.name}", unset=(None,))
        for f in fields(JudgeRolloutConfig)
    },
    "reward_model.model.external_lib": Only((None,), "importing a model library"),
    "reward_model.model.trust_remote_code": Only((None, False), "reward models with remote code"),
    "reward_model.strategy": STRATEGY,
    "reward_model.use_reward_loop": Inert(
        "verl's switch between its reward paths; rayrl scores in its reward role"
    ),
    "reward_model.sandbox_fusion": Moved("reward.sandbox_fusion", unset=(None,)),
    "reward_model.model.use_remove_padding": Inert("the reward model scores padded batches"),
    "reward_model.model.fsdp_config": Inert(
        "the reward model runs unsharded, in bf16 on its GPU (fp32 on a CPU)"
    ),
    "reward_model.model.input_tokenizer": Inert(
        "responses are decoded with the actor's tokenizer and re-tokenised with the reward model's"
    ),
    "reward_model.launch_reward_fn_async": Inert(
        "rewards are scored beside the next stages anyway"
    ),
}

ALGORITHM: dict[str, Rule] = {
    "algorithm.filter_groups.max_inflight_gen_batches": Inert(
        "dynamic sampling generates one round at a time"
    ),
}

TRAINER: dict[str, Rule] = {
    "trainer.default_local_dir": Moved("trainer.output_dir", note=RUN_DIR),
    "trainer.log_val_generations": Moved("trainer.val_examples"),
    "trainer.esi_redundant_time": Inert("rayrl has no elastic-instance save deadline"),
    "trainer.checkpoint_callback_class": Only((None,), "checkpoint callbacks"),
    "trainer.default_hdfs_dir": Inert("rayrl writes checkpoints to trainer.output_dir only"),
    "trainer.del_local_ckpt_after_load": Inert("rayrl keeps trainer.max_actor_ckpt_to_keep"),
    "trainer.ray_wait_register_center_timeout": Inert("workers register through the KVStore"),
    "trainer.use_legacy_worker_impl": Inert("rayrl has one worker implementation"),
    "trainer.use_v1": Inert("rayrl has one trainer"),
    "trainer.v1": Inert("verl's v1 trainer settings; rayrl has one synchronous trainer"),
    "trainer.v1.trainer_mode": Only(("sync",), "asynchronous trainer modes"),
    # Added with Hydra's `+` by a verl recipe (DeepEyes); no verl tracker reads it.
    "trainer.rl_logging_board_dir": Inert(
        "the directory of an RL Logging Board tracker, which neither verl nor rayrl has; "
        "metrics go to the trackers of trainer.logger"
    ),
}

# Each role's `profiler` group lives under `global_profiler` (`rayrl.config.profiler`).
PROFILER: dict[str, Rule] = {
    **{verl: Moved(f"global_profiler.{role}") for role, verl in VERL_ROLE_GROUPS.items()},
    **{f"global_profiler.{role}": Inert(ROLE_PROFILER) for role in VERL_ROLE_GROUPS},
}


# A verl config file of one's own: Hydra's settings, and a defaults list that starts
# from verl's ppo_trainer (rayrl's schema defaults are verl's).
HYDRA: dict[str, Rule] = {
    "hydra": Inert("Hydra's own settings (search paths, run directories)"),
    "defaults": Only(
        (["ppo_trainer", "_self_"], ["ppo_trainer"], ["_self_"]),
        "Hydra defaults lists other than [ppo_trainer, _self_]",
        hint="put the settings of the other config files in this one",
    ),
}

OTHER: dict[str, Rule] = {
    "global_profiler": Inert(
        "rayrl reads global_profiler's tool, steps, profile_continuous_steps and save_path"
    ),
    **PROFILER,
    "transfer_queue": Inert("batches move through Ray's object store"),
    "transfer_queue.enable": Only((False,), "verl's TransferQueue"),
    "distillation.distillation_loss.topk": Inert(TOPK),
    "distillation.distillation_loss.log_prob_min_clamp": Inert(TOPK),
    "distillation.distillation_loss.clip_ratio": Inert(
        "rayrl's distillation term clips with clip_ratio_low and clip_ratio_high, which verl's "
        "vanilla policy loss reads"
    ),
    "distillation.distillation_loss.policy_loss_mode": Only(
        ("vanilla",),
        "a distillation policy loss other than PPO's clipped one",
        hint="set distillation.distillation_loss.policy_loss_mode=vanilla (verl's only choice)",
    ),
    "skip": Inert("rollout dumps for replay (off)"),
    "skip.*.enable": Only((False,), "replaying dumped rollouts"),
    "ray_kwargs": Inert(
        "rayrl starts or joins Ray itself (resources.address; runtime_env from the cluster)"
    ),
}

RULES: dict[str, Rule] = {
    **ACTOR,
    **REF,
    **ROLLOUT,
    **MODEL,
    **DATA,
    **CRITIC,
    **REWARD,
    **ALGORITHM,
    **TRAINER,
    **HYDRA,
    **OTHER,
}

"""verl's SFT trainer keys outside `rayrl sft`'s schema, each with its rule.

`rayrl sft` keeps the names of verl's `fsdp_sft_trainer` (`model.partial_pretrain`,
`data.prompt_key`, `optim.lr_scheduler`, ...). verl 0.9.1's engine-based SFT trainer
(`verl.trainer.sft_trainer`, `sft_trainer_engine.yaml`) renamed some of them
(`model.path`, `engine.*`, `optim.lr_scheduler_type`); both spellings work here. Its
multi-turn keys (`data.messages_key`, `data.tools_key`) are the legacy trainer's
`data.multiturn.*`, which `rayrl sft` reads (conversations with
`data.multiturn.enable=true`; otherwise (prompt, response) pairs from `data.prompt_key`
and `data.response_key`).
"""

from __future__ import annotations

from rayrl.config.compat.rules import Inert, Moved, Only, Rule
from rayrl.config.compat.verl_ppo import (
    CKPT,
    DEPRECATED,
    RUN_DIR,
    STRATEGY,
    _fsdp_config,
    _model,
)

CONVERSATIONS = "conversation rows need data.multiturn.enable=true"
PROFILER = (
    "rayrl sft takes no profiles (rayrl train does: global_profiler.tool=torch); its "
    "timing_s/* metrics are always on"
)
TEMPLATE = "rayrl renders each conversation with the model's chat template as it is"

RULES: dict[str, Rule] = {
    # verl 0.9.1's engine SFT trainer's names
    "model.path": Moved("model.partial_pretrain", note="the model to fine-tune"),
    "model.use_remove_padding": Moved("use_remove_padding"),
    "model.tokenizer_path": Only((None,), "a tokenizer from another path than the model"),
    "model.lora_adapter_path": Only((None,), "starting from a saved LoRA adapter"),
    **_model("model"),
    "engine": Moved("model.fsdp_config"),
    **_fsdp_config("model.fsdp_config"),
    # after the group's rules: the engine's offload switches are the legacy trainer's
    # (the PPO roles' rule for the reference's optimizer_offload must not win here)
    "model.fsdp_config.param_offload": Moved("model.fsdp_config.offload_params"),
    "model.fsdp_config.optimizer_offload": Moved("model.fsdp_config.cpu_offload"),
    "optim.lr_scheduler_type": Moved("optim.lr_scheduler"),
    "optim.warmup_style": Moved("optim.lr_scheduler", unset=(None,), note=DEPRECATED),
    "optim.optimizer": Only(("AdamW", "adamw"), "optimizers other than AdamW"),
    "optim.optimizer_impl": Only(("torch.optim",), "optimizers outside torch.optim"),
    "optim.total_training_steps": Inert(
        "the trainer sets it from trainer.total_training_steps or total_epochs"
    ),
    "optim.zero_indexed_step": Inert("rayrl's schedules count steps from 0"),
    "optim.override_optimizer_config": Only((None, {}), "optimizer constructor overrides"),
    "data.messages_key": Moved("data.multiturn.messages_key", note=CONVERSATIONS),
    "data.tools_key": Moved("data.multiturn.tools_key", note=CONVERSATIONS),
    "data.enable_thinking_key": Inert(TEMPLATE),
    "data.enable_thinking_default": Inert(TEMPLATE),
    "data.ignore_input_ids_mismatch": Inert(
        "rayrl tokenises a conversation message by message and trains on exactly those ids"
    ),
    "data.pad_mode": Inert("rows are packed with use_remove_padding, else padded"),
    "data.num_workers": Inert("the SFT data is tokenised in the driver"),
    "checkpoint": Inert(CKPT),
    "trainer.balance_batch": Inert("rayrl splits each batch evenly by rows"),
    "trainer.profile_interval": Inert(PROFILER),
    "profiler": Inert(PROFILER),
    # verl's fsdp_sft_trainer keys rayrl has no use for
    "model.fsdp_config.ulysses_sequence_parallel_size": Moved(
        "ulysses_sequence_parallel_size", note="verl 0.9.1's engine.ulysses_sequence_parallel_size"
    ),
    "model.use_liger": Inert("rayrl does not use Liger kernels"),
    "model.use_shm": Inert("models load from their directory as they are"),
    "data.use_shm": Inert("data files are read where they are"),
    "model.strategy": STRATEGY,
    "model.external_lib": Inert("import your model's package in a custom module of your own"),
    "model.fsdp_config.wrap_policy": Inert("rayrl wraps each decoder layer"),
    "data.balance_dp_token": Inert("rayrl splits each batch evenly by rows"),
    "data.micro_batch_size": Inert(
        "verl's fsdp_sft_trainer does not read it either: data.micro_batch_size_per_gpu "
        "sets the micro-batch"
    ),
    "data.chat_template": Only((None,), "custom chat templates"),
    "data.custom_cls.path": Only((None,), "custom dataset classes"),
    "data.custom_cls.name": Inert("a custom dataset class name (data.custom_cls.path is unset)"),
    "data.multiturn.enable_thinking_key": Inert(TEMPLATE),
    "trainer.default_local_dir": Moved("trainer.output_dir", note=RUN_DIR),
    "trainer.default_hdfs_dir": Inert("rayrl writes checkpoints to trainer.output_dir only"),
    "trainer.checkpoint": Inert(CKPT),
}

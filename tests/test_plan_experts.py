"""`rayrl plan` for mixtures of experts: parameters counted as transformers builds them
(total, active, in experts), expert parallelism in the per-GPU budget, and the expert-
parallel size it proposes, for Qwen3-30B-A3B on one node and Qwen3-235B-A22B on
several. The configs are transformers' own classes, written to temporary directories."""

from __future__ import annotations

from dataclasses import replace

import torch

from rayrl.cli.main import main
from rayrl.cli.plan_model import model_shape
from rayrl.models.memory import GiB, TrainingSetup, plan_memory, plans_by_ep

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_hidden_layers=48,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
)
QWEN3_235B_A22B = dict(
    QWEN3_30B_A3B,
    hidden_size=4096,
    num_hidden_layers=94,
    moe_intermediate_size=1536,
    num_attention_heads=64,
)
EP_KEY = "actor_rollout_ref.actor.expert_parallel_size"


def _save(tmp_path, name: str, config) -> str:
    path = tmp_path / name
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    return str(path)


def _qwen3_moe(tmp_path, name: str, sizes: dict) -> str:
    from transformers import Qwen3MoeConfig

    return _save(tmp_path, name, Qwen3MoeConfig(**sizes))


def _built_params(path: str) -> tuple[int, int]:
    """Parameters of the model transformers builds (on the meta device), and those in
    its experts' 3-D weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n
    )
    return total, experts


def test_parameters_of_qwen3_moe_as_transformers_builds_them(tmp_path):
    for name, sizes, total_b, active_b in (
        ("a3b", QWEN3_30B_A3B, 30.5, 3.3),
        ("a22b", QWEN3_235B_A22B, 235.1, 22.2),
    ):
        path = _qwen3_moe(tmp_path, name, sizes)
        shape = model_shape(path)
        assert not isinstance(shape, str), shape
        if name == "a3b":  # (the 235B's 94 layers take seconds to build, even on meta)
            assert (shape.params, shape.expert_params) == _built_params(path)
        assert round(shape.params / 1e9, 1) == total_b
        # the router picks 8 of 128 experts: a token meets 1/16 of the experts' weights
        active = shape.params - shape.expert_params + shape.expert_params * 8 // 128
        assert shape.active_params == active
        assert abs(shape.active_params / 1e9 - active_b) < 0.1


def test_sparse_layers_and_shared_experts_as_each_family_defines_them(tmp_path):
    """Qwen2-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) and gated
    shared expert, and Mixtral's ``num_local_experts`` of width ``intermediate_size``."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    qwen2 = Qwen2MoeConfig(
        **small,
        num_hidden_layers=6,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    mixtral = MixtralConfig(**small, num_hidden_layers=3, intermediate_size=80, num_local_experts=4)
    for name, config, sparse in (("qwen2", qwen2, 2), ("mixtral", mixtral, 3)):
        path = _save(tmp_path, name, config)
        shape = model_shape(path)
        assert not isinstance(shape, str), shape
        assert shape.experts is not None and shape.experts.sparse_layers == sparse
        assert (shape.params, shape.expert_params) == _built_params(path)


def _setup(**changes) -> TrainingSetup:
    settings = dict(
        nnodes=1,
        gpus_per_node=8,
        gpu_bytes=80 * GiB,
        optimizer_offload=True,
        ref_offload=True,
        rollout_tp=2,
        tokens_per_micro_batch=4096,
    )
    return TrainingSetup(**{**settings, **changes})


def test_expert_parallelism_shrinks_what_fsdp_gathers_not_the_shards(tmp_path):
    shape = model_shape(_qwen3_moe(tmp_path, "a3b", QWEN3_30B_A3B))
    assert not isinstance(shape, str)
    plans = {p.setup.ep: p for p in plans_by_ep(shape, _setup())}
    assert list(plans) == [1, 2, 4, 8]  # the divisors of 8 GPUs and 128 experts
    one, eight = ({p.name: p for p in plans[ep].phases} for ep in (1, 8))
    layer_experts = 128 * 3 * 2048 * 768
    dense = shape.gathered_layer(1) - layer_experts
    assert shape.gathered_layer(8) == dense + layer_experts // 8
    # two layers and the root in bf16, one layer's gradients in bf16 and float32
    gathered = (2 * (dense + layer_experts // 8) + shape.root_params) * 2
    assert eight["update"].items["gathered layers"] == gathered + (dense + layer_experts // 8) * 6
    assert one["update"].items["gathered layers"] > eight["update"].items["gathered layers"] + GiB
    # a rank's shard is 1/8 of every weight with or without expert parallelism
    assert eight["update"].items["actor weights"] == one["update"].items["actor weights"]
    # the reference splits its experts as the actor does (ref.expert_parallel_size unset);
    # at ref_ep=1 it gathers every expert of a layer
    ref_one = {p.name: p for p in plan_memory(shape, replace(_setup(), ep=8, ref_ep=1)).phases}
    assert eight["reference"].items["gathered layers"] < one["reference"].items["gathered layers"]
    assert (
        ref_one["reference"].items["gathered layers"] == (one["reference"].items["gathered layers"])
    )
    assert plans[8].peak.total < plans[1].peak.total
    # sequence parallelism and hybrid sharding leave no room for expert parallelism yet
    assert [p.setup.ep for p in plans_by_ep(shape, _setup(sp=2))] == [1]
    assert plan_memory(shape, replace(_setup(), ep=8)).fits


def _plan(path: str, *overrides: str, gpu_gib: float = 139.8) -> list[str]:
    model = f"actor_rollout_ref.model.path={path}"
    return ["plan", "--no-cluster", "--gpu-gib", str(gpu_gib), "-c", "grpo", model, *overrides]


COMMON = [
    "trainer.n_gpus_per_node=8",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
]


def test_plan_qwen3_30b_a3b_on_one_node_of_8_80gb(tmp_path, capsys):
    path = _qwen3_moe(tmp_path, "a3b", QWEN3_30B_A3B)
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    args = _plan(path, *COMMON, tp2, gpu_gib=80)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "30.53 B parameters, 3.35 B active per token" in out
    assert "128 per layer on 48 of 48 layers, 8 per token" in out
    assert f"FITS with {EP_KEY}=1" in out
    assert main([*args, f"{EP_KEY}=8"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 8: each rank holds 16 of 128 per layer" in out
    assert f"FITS with {EP_KEY}=8 (the smallest that fits is 1)" in out


def test_plan_qwen3_235b_a22b_fits_on_several_nodes_only(tmp_path, capsys):
    path = _qwen3_moe(tmp_path, "a22b", QWEN3_235B_A22B)
    settings = [
        *COMMON,
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    ]
    assert main(_plan(path, *settings, "trainer.nnodes=1")) == 2  # 8 H200s
    out = capsys.readouterr().out
    assert "235.09 B parameters, 22.19 B active per token" in out
    assert f"DOES NOT FIT on 1 node(s) x 8 GPU(s) of 139.8 GiB at any {EP_KEY}" in out
    assert f"it fits on trainer.nnodes=2 with {EP_KEY}=2" in out
    assert "rollout weights 54.7 GiB (a larger" in out  # the whole model over TP 8
    # on two nodes, EP 1 gathers too much of each layer; the smallest EP that fits is 2
    assert main(_plan(path, *settings, "trainer.nnodes=2")) == 2
    assert f"set {EP_KEY}=2: the smallest that fits" in capsys.readouterr().out
    assert main(_plan(path, *settings, "trainer.nnodes=2", f"{EP_KEY}=2")) == 0
    assert f"FITS with {EP_KEY}=2" in capsys.readouterr().out


def test_plan_names_a_mixture_no_family_reads(tmp_path, capsys):
    import json

    path = tmp_path / "m"
    path.mkdir()
    config = {**QWEN3_30B_A3B, "model_type": "deepseek_v3", "n_routed_experts": 8}
    (path / "config.json").write_text(json.dumps(config))
    assert main(_plan(str(path), *COMMON)) == 0
    out = capsys.readouterr().out
    assert "not estimated" in out and "qwen3_moe" in out and "deepseek_v3" in out

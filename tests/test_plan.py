"""`rayrl plan` against a real local Ray: pools from a config, placement, verdict; and
without a cluster, the training mesh and the per-GPU memory budget."""

from __future__ import annotations

import pytest
import ray

from rayrl.cli.main import main
from rayrl.config import load_config
from rayrl.trainer.resources import pools_from_config, resolve_device


def test_pools_from_config_follow_the_topology():
    cfg = load_config(
        "grpo",
        [
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "resources.capacity_factor=1.25",
        ],
    )
    assert resolve_device(cfg, cluster_gpus=8) == "cuda"
    assert resolve_device(cfg, cluster_gpus=0) == "cpu"
    actor, reward = pools_from_config(cfg, "cuda")
    assert actor.per_node == [4, 4] and actor.bundle == {"CPU": 1.0, "GPU": 1.0}
    assert actor.num_spares == 2
    # one reward worker on each of the actor's nodes, pinned there node by node
    assert reward.per_node == [1, 1] and reward.strategy == "STRICT_PACK"
    assert reward.align_with == actor.name
    assert reward.bundle == {"CPU": 1.0} and reward.num_spares == 1
    assert "GPU" not in pools_from_config(cfg, "cpu")[0].bundle
    wider = load_config(
        "grpo",
        [
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "reward.workers_per_node=3",
            "reward.cpus_per_worker=2",
            "reward_model.enable=true",
            "reward_model.model.path=/rm",
            "reward_model.micro_batch_size_per_gpu=2",
        ],
    )
    # a reward model: a data-parallel rank per GPU, 3 GPUs on each of the 2 nodes
    _, model = pools_from_config(wider, "cuda")
    assert model.per_node == [3, 3] and model.bundle == {"CPU": 2.0, "GPU": 1.0}
    from rayrl.config import ConfigError

    for bad in ("reward.workers_per_node=0", "reward.cpus_per_worker=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config("grpo", [bad])


def test_plan_fits_and_never_fits(ray_local, capsys):
    address = ray.get_runtime_context().gcs_address
    assert main(["plan", "--address", address, "-c", "grpo", "trainer.device=cuda"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "actor_rollout_ref" in out and "STRICT_PACK" in out
    # 8 GPU bundles on one node of 4 GPUs can never be placed.
    code = main(
        [
            "plan",
            "--address",
            address,
            "-c",
            "grpo",
            "trainer.device=cuda",
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    assert code == 2
    assert "NEVER" in capsys.readouterr().out
    # the reward's workers per node, on the actor's nodes
    overrides = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "reward.workers_per_node=2"]
    assert main(["plan", "--address", address, "-c", "grpo", *overrides]) == 0
    out = capsys.readouterr().out
    assert "STRICT_PACK on actor_rollout_ref's nodes" in out
    assert "reward: 2 worker(s), 2 on each of the 1 node(s) of actor_rollout_ref" in out


def test_plan_exits_1_while_resources_are_held(ray_local, capsys):
    from ray.util.placement_group import placement_group, remove_placement_group

    address = ray.get_runtime_context().gcs_address
    holder = placement_group([{"GPU": 4.0}], name="rayrl/other/gpus")
    assert holder.wait(10)
    try:
        assert main(["plan", "--address", address, "trainer.device=cuda"]) == 1
        out = capsys.readouterr().out
        assert "BUSY" in out and "rayrl/other/gpus" in out
    finally:
        remove_placement_group(holder)


# ------------------------------------------------------------- mesh and memory budget
QWEN25_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
QWEN25_72B = {
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
}
# The 7B GRPO run of docs/benchmarks.md (session 5, one H200): bf16 master weights and Adam
# moments (moments offloaded), bf16 reference offloaded, activation checkpointing, 8,192
# tokens per micro-batch, 16 x (256 + 256) tokens, native rollout at 0.2 of the GPU.
MEASURED_7B_GIB = 92.7  # the actor process's peak reserved memory in update_actor
SETTINGS_7B = [
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=1",
    "data.train_batch_size=2",
    "data.max_prompt_length=256",
    "data.max_response_length=256",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
]


def _model_dir(tmp_path, shape: dict) -> str:
    import json

    path = tmp_path / "model"
    path.mkdir(parents=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _totals(out: str) -> dict[str, float]:
    line = next(x for x in out.splitlines() if x.strip().startswith("total"))
    generate, reference, update = (float(v) for v in line.split()[1:4])
    return {"generate": generate, "reference": reference, "update": update}


def test_plan_7b_on_one_h200_against_the_measured_peak(tmp_path, capsys):
    """The budget of the measured 7B run fits one H200, and its update peak (live tensors)
    stays below the measured peak the caching allocator reserved, within a factor 2."""
    model = _model_dir(tmp_path, QWEN25_7B)
    args = ["plan", "--no-cluster", "-c", "grpo", f"actor_rollout_ref.model.path={model}"]
    assert main([*args, *SETTINGS_7B]) == 0
    out = capsys.readouterr().out
    assert "7.62 B parameters" in out and "1 rank(s): one rank, nothing sharded" in out
    assert "FITS: peak" in out and "(update)" in out
    totals = _totals(out)
    assert 0.5 * MEASURED_7B_GIB < totals["update"] < MEASURED_7B_GIB
    # the generation phase holds weights, the rollout's 0.2 share and the context: the
    # 44.8 GiB nvidia-smi read after the 7B run's start (bench/results, session 5 log)
    assert abs(totals["generate"] - 44.8) < 2.0


def _setup_72b(**changes):
    from rayrl.models.memory import GiB, TrainingSetup

    settings = dict(
        nnodes=8,
        gpus_per_node=8,
        gpu_bytes=139.8 * GiB,
        master_dtype="bf16",
        optimizer_offload=True,
        fsdp_size=8,
        sp=4,
        tokens_per_micro_batch=32768,
        response_share=30720 / 32768,
        ref_offload=True,
        ref_fsdp_size=8,
        rollout_tp=8,
        gpu_memory_utilization=0.4,
    )
    return TrainingSetup(**{**settings, **changes})


def test_memory_budget_72b_grpo_on_8_nodes_of_8_h200():
    """Qwen2.5-72B, HSDP (shard in a node of 8, replicate over 8 nodes), SP 4, TP 8
    rollout, bf16 master weights with Adam moments and the reference offloaded: fits; the
    same with fp32 master weights and nothing offloaded does not."""
    from rayrl.models.memory import GiB, ModelShape, plan_memory

    shape = ModelShape.from_config(QWEN25_72B)
    assert round(shape.params / 1e9, 2) == 72.71
    budget = plan_memory(shape, _setup_72b())
    update = {p.name: p for p in budget.phases}["update"]
    assert update.items["actor weights"] == shape.params * 2 / 8  # sharded over a node
    assert update.items["rollout weights"] == shape.params * 2 / 8  # split over TP 8
    assert update.items["Adam moments"] == 4 * GiB  # the offloaded step's slice
    assert update.items["activations"] == 8192 * (80 * 2 * 8192 + shape.activation_bytes())
    assert budget.fits and budget.peak.name == "update"
    assert budget.host_per_node["Adam moments"] == 8 * 2 * shape.params * 2 / 8
    text = budget.render()
    assert "64 rank(s): HSDP, shard 8 x replicate 8" in text and "Ulysses SP 4" in text
    assert "tensor parallel 8 (8 replica(s))" in text
    heavy = plan_memory(shape, _setup_72b(master_dtype="fp32", optimizer_offload=False))
    assert not heavy.fits and "DOES NOT FIT" in heavy.render()


def test_an_fp8_rollout_holds_its_dense_matrices_in_one_byte():
    """Qwen2.5-72B's rollout weights with rollout.quantization=fp8: the embeddings, head
    and norms in bf16, each layer's q/k/v, o, gate/up and down in one byte; the KV cache
    gets the difference."""
    from dataclasses import replace

    from rayrl.models.memory import ModelShape, plan_memory

    shape = ModelShape.from_config(QWEN25_72B)
    matrices = 80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 29568)
    assert shape.dense_matrix_params == matrices
    bf16 = {p.name: p for p in plan_memory(shape, _setup_72b()).phases}["generate"]
    fp8 = {p.name: p for p in plan_memory(shape, replace(_setup_72b(), rollout_fp8=True)).phases}
    saved = bf16.items["rollout weights"] - fp8["generate"].items["rollout weights"]
    assert saved == matrices / 8  # one byte fewer each, split over TP 8
    kv = fp8["generate"].items["rollout KV cache"] - bf16.items["rollout KV cache"]
    assert kv == saved


def _has_rollout_tp() -> bool:
    from rayrl.config.schema import RolloutConfig, schema_fields

    return "tensor_model_parallel_size" in schema_fields(RolloutConfig)


@pytest.mark.skipif(not _has_rollout_tp(), reason="needs rollout.tensor_model_parallel_size")
def test_plan_72b_from_the_command_line(tmp_path, capsys):
    model = _model_dir(tmp_path, QWEN25_72B)
    args = [
        "plan",
        "--no-cluster",
        "-c",
        "grpo",
        f"actor_rollout_ref.model.path={model}",
        "trainer.nnodes=8",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=64",
        "data.max_prompt_length=2048",
        "data.max_response_length=30720",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=8",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "HSDP, shard 8 x replicate 8" in out and "data parallel 16 x Ulysses SP 4" in out
    assert "FITS" in out and "72.71 B parameters" in out
    assert (
        main(
            [
                *args,
                "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
            ]
        )
        == 2
    )
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_plan_counts_a_distillation_teacher_in_the_actor_s_processes(tmp_path, capsys):
    """A 7B teacher beside the 7B student on one H200, offloaded as the reference is: its
    weights are in host memory, and the phase it scores in holds them on the GPU; a 72B
    teacher does not fit there, and the plan says so (exit 2)."""
    student = _model_dir(tmp_path / "s", QWEN25_7B)
    args = ["plan", "--no-cluster", "-c", "grpo", f"actor_rollout_ref.model.path={student}"]
    for shape, name, fits in ((QWEN25_7B, "t7", True), (QWEN25_72B, "t72", False)):
        teacher = _model_dir(tmp_path / name, shape)
        keys = [
            "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
        ]
        assert main([*args, *SETTINGS_7B, *keys]) == (0 if fits else 2)
        out = capsys.readouterr().out
        header = next(x for x in out.splitlines() if "generate" in x and "update" in x)
        assert header.split()[-1] == "teacher"
        row = next(x for x in out.splitlines() if x.strip().startswith("teacher weights"))
        gib = 7.62 if fits else 72.71
        assert abs(float(row.split()[-1]) - gib * 1e9 * 2 / 2**30) < 0.2  # bf16, on the GPU
        assert float(row.split()[2]) == 0.0  # offloaded while the actor generates
        assert ("FITS" if fits else "DOES NOT FIT") in out
        assert "teacher weights" in out.split("host memory per node")[1]

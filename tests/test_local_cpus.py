"""A CPU-only run whose pools need far more logical CPUs than the machine has cores:
`rayrl train` refuses it before Ray starts and `rayrl plan` says it never fits, both
by one rule (`rayrl.trainer.resources.local_cpu_count`: at most 4 a core), while a
2-core laptop still runs the tools demo asynchronously (3 logical CPUs)."""

from __future__ import annotations

import os

import pytest
import ray

from rayrl.cli.common import checked_config
from rayrl.cli.main import main
from rayrl.cli.running import exit_code_of
from rayrl.cli.train_cmd import train
from rayrl.cluster.guard import ResourcesUnsatisfiable
from rayrl.models import build_tiny_model
from rayrl.trainer.resources import local_cpu_count, pools_from_config

ASYNC = ["actor_rollout_ref.rollout.mode=async", "trainer.device=cpu"]
SAYS = (
    "this CPU-only run needs 66 logical CPUs (actor_rollout_ref 2 (1 x 2 CPUs), rollout 64 "
    "(64 x 1 CPU)) and this machine has 2 cores: a local run shares its cores among its "
    "workers up to 4 logical CPUs a core (8 here)"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), layers=1, hidden=32)


@pytest.fixture
def two_cores_no_ray(monkeypatch):
    """This machine as a 2-core laptop with no Ray running; a Ray start records its
    arguments and stops the command there."""
    started: list[dict] = []

    def init(**kwargs):
        started.append(kwargs)
        raise RuntimeError("stop: Ray would start here")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    return started


def demo_tools(model, *extra: str, out=None):
    overrides = [f"actor_rollout_ref.model.path={model}", *ASYNC, *extra]
    if out is not None:
        overrides.append(f"trainer.output_dir={out}")
    return checked_config("demo_tools", overrides, warn=lambda message: None)


def test_a_cpu_run_may_share_a_core_among_at_most_four_workers(model):
    one = pools_from_config(demo_tools(model, "rollout.n_gpus_per_node=1"), "cpu")
    assert local_cpu_count(one, cores=2) == 3  # the trainer (and the reward), one replica
    many = pools_from_config(demo_tools(model, "rollout.n_gpus_per_node=64"), "cpu")
    with pytest.raises(ResourcesUnsatisfiable) as refused:
        local_cpu_count(many, cores=2)
    assert str(refused.value).startswith(SAYS)
    assert "Lower rollout.n_gpus_per_node=64 (or rollout.cpus_per_replica)" in str(refused.value)
    assert local_cpu_count(many, cores=17) == 66  # within 4 a core: shared


def test_train_refuses_a_rollout_pool_far_larger_than_the_machine_before_ray(
    tmp_path, model, two_cores_no_ray, capsys
):
    cfg = demo_tools(model, "rollout.n_gpus_per_node=64", out=tmp_path)
    code = exit_code_of(lambda: train(cfg))
    err = capsys.readouterr().err
    assert code == 2 and not two_cores_no_ray, err
    assert err.startswith(f"resources error: {SAYS}") and len(err.strip().splitlines()) == 1


def test_plan_says_never_where_train_refuses_and_starts_ray_as_train_would(
    model, two_cores_no_ray, capsys
):
    base = ["plan", "-c", "demo_tools", f"actor_rollout_ref.model.path={model}", *ASYNC]
    assert main([*base, "rollout.n_gpus_per_node=64"]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"NEVER: {SAYS}") and not two_cores_no_ray
    with pytest.raises(RuntimeError, match="Ray would start here"):
        main([*base, "rollout.n_gpus_per_node=1"])
    assert two_cores_no_ray[0]["num_cpus"] == 3  # as `rayrl train` starts it

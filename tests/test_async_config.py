"""`rollout.mode=async` in the config, without Ray: its keys checked, the rollout pool it
adds (what `rayrl plan` shows), the staleness bound and the correction it turns on."""

from __future__ import annotations

import re

import pytest

from rayrl.config import load_config
from rayrl.config.errors import ConfigError
from rayrl.trainer.async_ppo import max_lag, window, with_async_correction
from rayrl.trainer.resources import local_cpu_count, pools_from_config

ASYNC = ["actor_rollout_ref.rollout.mode=async", "trainer.device=cpu"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("async_training.staleness_threshold=-1", "staleness_threshold=-1.0 must be >= 0"),
        ("async_training.trigger_parameter_sync_step=0", "trigger_parameter_sync_step=0"),
        ("rollout.gpus_per_replica=0", "rollout.gpus_per_replica=0.0 must be in (0, 1]"),
        ("rollout.max_replicas=2", "rollout.max_replicas=2 is below the declared replicas"),
        ("algorithm.adv_estimator=remax", "does not support remax's greedy baselines"),
        ("actor_rollout_ref.rollout.mode=later", "rollout.mode='later' is not one of sync"),
        ("async_training.weight_transport=nccl", "picks NCCL itself on GPUs"),
        ("async_training.weight_transport=pigeon", "not one of object_store, collective"),
        ("async_training.weight_sync_timeout_s=0", "weight_sync_timeout_s=0.0 must be > 0"),
    ],
)
def test_async_keys_are_checked_before_anything_starts(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("grpo", [*ASYNC, "rollout.n_gpus_per_node=4", override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("async_training.staleness_threshold=-1", "staleness_threshold=-1.0 must be >= 0"),
        ("async_training.trigger_parameter_sync_step=0", "trigger_parameter_sync_step=0"),
        ("async_training.prompts_per_call=0", "prompts_per_call=0 must be >= 1"),
        ("async_training.calls_per_replica=0", "calls_per_replica=0 must be >= 1"),
    ],
)
def test_async_ranges_are_checked_without_a_rollout_pool_too(override, message):
    """mode=async with no pool trains synchronously, but a key out of its range is still
    a config error: it must not wait for the day the pool is declared."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("grpo", [*ASYNC, override])
    load_config("grpo", ASYNC)  # in range: a warning, no error


def test_the_rollout_pool_comes_last_pinned_per_node_with_its_bundle():
    cfg = load_config(
        "grpo",
        [
            *ASYNC,
            "rollout.nnodes=2",
            "rollout.n_gpus_per_node=3",
            "rollout.cpus_per_replica=2",
            "rollout.gpus_per_replica=0.5",
            "resources.gpus_per_worker=0.5",
        ],
    )
    trainer, reward, rollout = pools_from_config(cfg, "cuda")  # the reward's own on a GPU
    assert trainer.bundle == {"CPU": 1.0, "GPU": 0.5} and reward.name == "reward"
    assert rollout.name == "rollout" and rollout.per_node == [3, 3]
    assert rollout.bundle == {"CPU": 2.0, "GPU": 0.5} and rollout.strategy == "STRICT_PACK"
    sync = load_config("grpo", ["trainer.device=cpu"])
    assert [p.name for p in pools_from_config(sync, "cpu")] == ["actor_rollout_ref"]


def test_a_cpu_run_whose_pools_outgrow_the_cores_gets_logical_cpus_for_them():
    cfg = load_config("grpo", [*ASYNC, "rollout.n_gpus_per_node=1", "trainer.device=cpu"])
    specs = pools_from_config(cfg, "cpu")  # trainer, reward, one replica: a CPU each
    assert local_cpu_count(specs, cores=2) == 3
    assert local_cpu_count(specs, cores=3) is None  # the cores hold them: Ray counts
    spares = load_config("grpo", ["trainer.device=cpu", "resources.capacity_factor=2"])
    # one rank scoring in its own process (2 CPUs) and its spare
    assert local_cpu_count(pools_from_config(spares, "cpu"), cores=1) == 4


def test_verls_default_async_mode_without_a_pool_stays_synchronous_and_says_so():
    """verl 0.9.1's main_ppo defaults to rollout.mode=async (its agent-loop server inside
    synchronous steps): without a pool of its own, rayrl trains synchronously."""
    said: list[str] = []
    cfg = load_config("grpo", ASYNC, warn=said.append)
    assert not cfg.asynchronous and [p.name for p in pools_from_config(cfg, "cpu")] == [
        "actor_rollout_ref"
    ]
    assert any("training stays synchronous" in m for m in said), said
    with pytest.raises(ConfigError, match="set actor_rollout_ref.rollout.mode=async too"):
        load_config("grpo", ["trainer.device=cpu", "rollout.n_gpus_per_node=1"])


def test_staleness_bound_admission_and_correction():
    def cfg(*extra):
        return load_config("grpo", [*ASYNC, "rollout.n_gpus_per_node=1", *extra])

    exact = cfg(
        "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"
    )
    assert (max_lag(exact.async_training), window(exact.async_training)) == (0, 1.0)
    printed: list[str] = []
    assert with_async_correction(exact, printed.append) is exact and not printed
    verl = cfg()  # verl's defaults: staleness 0.1, weights every 4 steps
    assert max_lag(verl.async_training) == 7 and window(verl.async_training) == pytest.approx(4.4)
    corrected = with_async_correction(verl, printed.append)
    assert corrected.algorithm.rollout_correction.rollout_is == "token"
    assert verl.algorithm.rollout_correction.rollout_is is None  # the caller's is untouched
    assert "truncated importance ratios" in printed[0]
    chosen = cfg("algorithm.rollout_correction.rollout_is=sequence")
    assert with_async_correction(chosen, printed.append) is chosen

"""Asynchronous training (`actor_rollout_ref.rollout.mode=async`) through the product path,
on real Ray with real processes: the trainer's hybrid actor, a rollout replica in a
process of its own, the sample queue between them.

- staleness 0 without partial rollouts is the synchronous run, bitwise (metrics but the
  wall-clock ones, final weights), across a checkpoint and a resume too;
- staleness 1 with a replica SIGKILLed mid-generation and a trainer rank SIGKILLed in
  its update: the lost call's prompts are queued again, the step replayed, and every
  prompt trains exactly once (the per-epoch ledger, the run's own ledger);
- elastic: on a two-node `ray.cluster_utils.Cluster`, the node of one replica is
  removed mid-run (training goes on with one), a node is added and a new replica
  starts there, takes the current policy and generates.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from async_cases import ReplicaKiller
from rayrl.config import load_config
from rayrl.models import build_tiny_model
from rayrl.testing.chaos import deterministic, final_weights
from rayrl.testing.faults import Fault, inject
from rayrl.trainer.async_ppo import AsyncPPOTrainer
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.report import write_report
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow

SMALL = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.device=cpu",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
]
ASYNC = [
    "actor_rollout_ref.rollout.mode=async",
    "rollout.n_gpus_per_node=1",
    "async_training.trigger_parameter_sync_step=1",
]
EXACT = [*ASYNC, "async_training.staleness_threshold=0", "async_training.partial_rollout=false"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("async-model") / "tiny"
    return str(build_tiny_model(out, layers=2, hidden=64, seed=1, overwrite=True))


def fit(
    model: str,
    out: Path,
    extra: list[str],
    trainer_cls=AsyncPPOTrainer,
    helper=None,
    on_step=None,
):
    """One run; `helper(run)` (started before fit) returns something with `stop()`;
    `on_step(run, step)` runs in the driver after each step."""
    cfg = load_config(
        "grpo",
        [*SMALL, *extra, f"trainer.output_dir={out}", f"actor_rollout_ref.model.path={model}"],
    )
    printed: list[str] = []
    run = Run(trainer_cls(cfg, print_fn=printed.append))
    started = None
    try:
        run.setup()
        started = helper(run) if helper else None
        history = run.fit(on_step=on_step and (lambda step, _: on_step(run, step)))
    finally:
        if started is not None:
            started.stop()
        run.shutdown()
    return run, history, printed


def test_staleness_zero_is_the_synchronous_run_bitwise_and_resumes_exactly(
    ray_local, model, tmp_path
):
    three = ["trainer.total_training_steps=3"]
    _, sync, _ = fit(model, tmp_path / "sync", three, PPOTrainer)
    # the async run stops after 2 steps (a checkpoint at its end), then resumes to 3
    out = tmp_path / "async"
    _, first, _ = fit(model, out, [*EXACT, "trainer.total_training_steps=2"])
    run, rest, printed = fit(model, out, [*EXACT, *three, "trainer.resume_mode=auto"])
    assert any("resumed from" in line for line in printed)
    history = first + rest
    assert len(history) == len(sync) == 3
    for want, got in zip(sync, history, strict=True):
        same = deterministic(want)
        assert {k: got.get(k) for k in same} == same
        assert got["async/staleness/max"] == 0 and got["async/dropped"] == 0
        assert 0 <= got["perf/train_idle_fraction"] <= 1
    weights, mine = final_weights(tmp_path / "sync"), final_weights(out)
    assert weights.keys() == mine.keys()
    assert all(torch.equal(weights[k], mine[k]) for k in weights)
    # the resumed run published its policy (step 2's) to the fresh replica
    assert rest[0]["timing_s/weight_publish"] > 0 and rest[0]["async/weight_sync_ms"] > 0
    ledger = run.trainer.queue.ledger
    assert ledger.count(0) == 6 and sum(ledger.requeued.values()) == 0
    # `rayrl report` plots the async metrics
    report = write_report(out).parent
    for name in ("async_staleness", "async_queue", "async_idle"):
        assert (report / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name


def test_a_killed_replica_and_a_killed_trainer_rank_lose_and_repeat_no_prompt(
    ray_local, model, tmp_path
):
    steps = 5
    extra = [
        *ASYNC,
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
        "actor_rollout_ref.rollout.ignore_eos=true",  # every call decodes all its tokens
        "data.max_response_length=24",
        f"trainer.total_training_steps={steps}",
        "trainer.resume_mode=disable",
    ]

    def kill_in_update(run: Run, step: int) -> None:  # step 3: trainer rank 0 in its update
        if step == 2:
            inject(run.trainer.roles.hybrid, Fault("update_actor", "kill", ranks=(0,)))

    run, history, printed = fit(
        model,
        tmp_path / "run",
        extra,
        helper=lambda run: ReplicaKiller(run, after_step=1),
        on_step=kill_in_update,
    )
    assert len(history) == steps
    trainer = run.trainer
    events = [e["event"] for e in trainer.rollouts.events]
    assert events[:2] == ["lost", "joined"], printed
    assert any("rollout replica" in line and "lost" in line for line in printed)
    # the trainer rank was replaced and its step replayed
    assert run.replay.recoveries and run.replay.recoveries[0]["stage"] == "update_actor"
    ledger = trainer.queue.ledger
    assert ledger.requeued["replica_lost"] >= 1
    assert ledger.count(0) == steps * 2  # every prompt of the 5 batches, once
    trained = [uid for _, uids in run.replay.ledger for uid in uids]
    assert len(trained) == len(set(trained)) == steps * 2
    for row in history:
        assert row["async/staleness/max"] <= 1
        assert row["async/replicas"] >= 0


def test_replicas_leave_with_their_node_and_join_when_a_node_is_added(
    ray_multinode, model, tmp_path
):
    # head: the trainer (its bundle holds the reward's CPU too) and one replica; the
    # second replica on a node of its own
    cluster = ray_multinode([{"num_cpus": 3}, {"num_cpus": 1}])
    worker_node = cluster.list_all_nodes()[1]
    steps = 6
    extra = [
        *ASYNC,
        "rollout.nnodes=2",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=false",
        f"trainer.total_training_steps={steps}",
        "trainer.resume_mode=disable",
    ]

    seen: dict = {}

    def choreography(run: Run, step: int) -> None:
        """After the first step the worker node goes; after the third a node is added
        and the run waits (bounded) for a replica to join there; at the end, the
        replicas' calls."""
        rollouts = run.trainer.rollouts
        if step == 0:
            cluster.remove_node(worker_node)
        elif step == 2:
            seen["added"] = add_node(cluster, num_cpus=1)
            until(lambda: any(e["event"] == "joined" for e in rollouts.events))
        elif step == steps - 1:
            seen["calls"] = {r.name: r.calls for r in rollouts.replicas}

    run, history, printed = fit(model, tmp_path / "run", extra, on_step=choreography)
    events = [e for e in run.trainer.rollouts.events if e["event"] != "stopped"]
    assert [e["event"] for e in events] == ["lost", "joined"], printed
    lost, joined = events
    assert lost["node"] == worker_node.node_id
    assert joined["node"] not in (worker_node.node_id, cluster.head_node.node_id)
    assert seen["calls"][joined["replica"]] > 0  # it took the policy and generated
    assert len(history) == steps
    assert min(row["async/replicas"] for row in history) == 1
    assert run.trainer.queue.ledger.count(0) == steps * 2


def add_node(cluster, **resources):
    """`cluster.add_node`, tried again when the new raylet misses Ray's 30 s start-up
    deadline (a loaded machine)."""
    for attempt in range(3):
        try:
            return cluster.add_node(**resources)
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception here
            if "timed out during startup" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def until(condition, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)

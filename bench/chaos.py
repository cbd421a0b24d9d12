"""Chaos harness: a seeded GRPO run on CPU, workers SIGKILLed by pid, against a clean run.

Runs the same config twice on one local Ray (8 logical CPUs, no dashboard): once
clean, once with `rayrl.testing.chaos.ChaosMonkey` killing `--kills` worker processes
(at most one per step) at random points: generation, weight sync, reward, log-prob,
update. Both go through `PPOTrainer.fit` with the real roles (the hybrid actor /
rollout / reference sharded over 2 ranks, the reward worker). Prints JSON lines:

- `kills` (landed, with `planned` and every `missed` try: a kill that misses its step
  is tried again at the next), `kills_not_landed` (target 0: each planned kill that
  never landed, with its misses and why, e.g. no step left; also said on stderr, and
  the harness then exits with status 1), `kills_survived` (kills of a run that then
  finished), `weights_identical`
  (1: the final weights are bitwise those of the clean run), `metrics_identical`
  (every per-step metric but wall-clock ones), `ledger_ok` (each step trained the same
  prompt uids as the clean run, none twice);
- `recovery_p50_s`, `recovery_max_s`: from a kill to the end of its recovery;
- `snapshot_overhead_per_step_s`: the step-boundary snapshot's time per step (median;
  `target` 5% of the median step) and `snapshot_overhead_fraction` (its median ratio
  to the step's time, measured in the same steps; target 0.05).

With `--async` the run is asynchronous (`rollout.mode=async`, staleness 1, partial
rollouts, two rollout replicas beside the two training ranks): the monkey kills
training ranks in reward, log-prob and update calls, and as many rollout replicas in
the middle of generation (with `--agent`, of their episodes: the replicas run the
multi-turn episodes, and a kill may land while an episode's tools run); an async run
is not bitwise repeatable, so there is no clean run, and what is checked is the ledger
(`ledger_ok`: every prompt of the steps trained exactly once, none lost or twice),
with `requeued` (prompts generated again) and the replicas lost and joined. (At
staleness 0 an async agent run with a replica killed mid-episode is the synchronous
run bitwise: tests/test_async_agents.py.)

The model is a tiny Qwen2 (4 layers, hidden 256, random weights) built in `--out`.

`--transport collective` (with `--async`): the replicas take each version by a
broadcast from actor rank 0 (`async_training.weight_transport=collective`, its timeout
`--sync-timeout` seconds); `--replica-kill-at any` kills a replica at a random moment
of the step, whatever it is doing (receiving a broadcast included), instead of in the
middle of generation. Added records: `weight_publish_max_s` (the longest publish of the
run, the broadcast's wait included; target 10 s: a replica lost during a broadcast
costs seconds, not the timeout) and `weight_transport_fallbacks` (versions a replica
took from the object store instead; at least one per replica lost in a broadcast).

`--agent`: multi-turn episodes (`rollout.multi_turn.enable`), each assistant turn
answered by a tool call of 0.3 s (`bench/_agent_env.py`: the random model ends a turn
about every 8 tokens, two tool calls an episode), and the kills may also land while
an episode's tools run (stage `tools`); `--stages` picks the kill points.
Usage: `python bench/chaos.py [--steps 10] [--kills 10] [--seed 0] [--out DIR] [--device cuda]
[--agent] [--stages gen,tools,...] [--async] [--transport collective]
[--replica-kill-at any]`
(`--device cuda`: the two ranks on two GPUs over NCCL; `recovery_s` is then issue 14's
recovery after killing one rank mid-step).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from _agent_env import ENVIRONMENT, end_turns_often
from _common import emit_line, hardware
from rayrl.config import load_config
from rayrl.models import build_tiny_model
from rayrl.testing.chaos import DEFAULT_STAGES, POINTS, ChaosMonkey, compare_runs, final_weights
from rayrl.testing.kill_plan import KillPlan
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

BENCH = "chaos"
AGENT = [  # multi-turn episodes whose every turn runs a 0.3 s tool (bench/_agent_env.py)
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    f"actor_rollout_ref.rollout.agent.default_agent_loop={Path(__file__).parent / '_agent_env.py'}"
    f":{ENVIRONMENT}",
    "actor_rollout_ref.rollout.multi_turn.environment_config.latency_s=0.3",
    "actor_rollout_ref.rollout.multi_turn.environment_config.calls=2",
]


def overrides(steps: int, out: str, model: str, device: str = "cpu") -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=8",
        "data.max_response_length=32",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        f"trainer.device={device}",
        "trainer.n_gpus_per_node=2",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
        "trainer.save_freq=5",
        f"trainer.output_dir={out}",
        "trainer.seed=0",
    ]


ASYNC = [
    "actor_rollout_ref.rollout.mode=async",
    "rollout.n_gpus_per_node=2",
    "async_training.staleness_threshold=1",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.partial_rollout=true",
    "async_training.prompts_per_call=2",
]


class ReplicaKiller:
    """SIGKILLs a random rollout replica of an async run while it generates, at most
    once a step, `kills` times (the replicas' own chaos monkey). Its accounts are a
    `KillPlan`: a step that passes without a kill is a miss, kept with what was seen,
    and the kill is tried again at the next step; kills left when the run ends are
    listed with why."""

    def __init__(self, run, seed: int, kills: int, at: str = "gen") -> None:
        import random
        import threading

        self.run, self.kills, self.rng, self.at = run, kills, random.Random(seed + 1), at
        self.plan = KillPlan(kills)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def done(self) -> list[dict]:
        return self.plan.done

    def _loop(self) -> None:
        why = ""
        try:
            self._watch()
        except Exception as err:  # noqa: BLE001 - said in the plan, never a silent end
            why = f"the replica killer failed: {type(err).__name__}: {err}"
        finally:
            step = self.run.progress.global_step
            self.plan.finish(why or f"the run ended (at step {step}) before a replica's kill")

    def _watch(self) -> None:
        import os
        import signal

        watching, seen = None, ""  # the step a kill is tried in, what was seen there
        while not self._stop.is_set() and self.plan.current is not None:
            time.sleep(0.01)
            step = self.run.progress.global_step
            if self.done and self.done[-1]["step"] >= step:
                continue
            if watching is not None and step != watching:
                reason = f"the step ended before a replica was seen generating ({seen})"
                self.plan.missed(watching, "gen", reason)
            if watching != step and self.at == "any":  # a random moment of the step
                time.sleep(self.rng.uniform(0.0, 1.5))
            watching = step
            replicas = list(self.run.trainer.rollouts.replicas)
            if not replicas:
                seen = "no replica alive"
                continue
            actor = self.rng.choice(replicas).group.actors[0]
            try:
                beat = ray.get(actor.heartbeat.remote(), timeout=2.0) if actor else None
            except Exception as err:  # noqa: BLE001 - being replaced: look again
                seen = f"a heartbeat failed: {type(err).__name__}"
                continue
            busy = (beat or {}).get("busy") or ""
            if not beat or (self.at == "gen" and not busy.endswith("generate")):
                seen = f"last seen {(beat or {}).get('busy') or 'idle'}"
                continue
            try:
                os.kill(beat["pid"], signal.SIGKILL)
            except OSError as err:
                seen = f"pid {beat['pid']} was gone before the kill ({err})"
                continue
            self.plan.landed(
                {"step": step, "pid": beat["pid"], "time": time.time(), "busy": busy or "idle"}
            )
            watching = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_async(args: argparse.Namespace, out: str) -> dict:
    """An async run under both monkeys; what the ledger says."""
    from rayrl.trainer.async_ppo import AsyncPPOTrainer

    extra = [*ASYNC, *(AGENT if args.agent else [])]
    if args.transport == "collective":
        extra += [
            "async_training.weight_transport=collective",
            f"async_training.weight_sync_timeout_s={args.sync_timeout}",
        ]
    cfg = load_config("grpo", [*overrides(args.steps, out, args.model, args.device), *extra])
    training = Run(AsyncPPOTrainer(cfg, print_fn=lambda text: print(text, file=sys.stderr)))
    monkey = killer = None
    history, error = [], None
    try:
        training.setup()
        stages = ["reward", "log_prob", "update"]
        monkey = ChaosMonkey(training, seed=args.seed, stages=stages, kills=args.kills).start()
        killer = ReplicaKiller(training, args.seed, args.kills, at=args.replica_kill_at)
        history = training.fit()
    except Exception as err:  # noqa: BLE001 - a run that did not survive is a result here
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        for helper in (monkey, killer):
            if helper is not None:
                helper.stop()
        training.shutdown()
    trainer = training.trainer
    trained = [u for _, uids in (training.replay.ledger if training.replay else []) for u in uids]
    return {
        "error": error,
        "history": history,
        "kills": (monkey.done if monkey else []) + (killer.done if killer else []),
        "plans": {
            "training ranks": monkey.plan if monkey else KillPlan(args.kills),
            "rollout replicas": killer.plan if killer else KillPlan(args.kills),
        },
        "trained": trained,
        "epoch_counts": {e: len(u) for e, u in trainer.queue.ledger.trained.items()},
        "requeued": dict(trainer.queue.ledger.requeued),
        "events": [e["event"] for e in trainer.rollouts.events] if trainer.rollouts else [],
        "batch": cfg.data.train_batch_size,
    }


def main_async(args: argparse.Namespace, root: str, start: float) -> int:
    """An async run under both monkeys; the planned kills that did not land."""
    chaos = run_async(args, f"{root}/async")
    kills = chaos["kills"]
    emit(
        "kills",
        len(kills),
        "kills",
        planned=2 * args.kills,
        steps=args.steps,
        mode="async",
        replicas_busy=[k["busy"] for k in kills if isinstance(k, dict) and "busy" in k],
    )
    survived = 0 if chaos["error"] else len(kills)
    emit(
        "kills_survived",
        survived,
        "kills",
        target=2 * args.kills,
        better="higher",
        error=chaos["error"],
    )
    trained = chaos["trained"]
    whole = len(chaos["history"]) == args.steps and len(trained) == args.steps * chaos["batch"]
    ledger_ok = whole and len(set(trained)) == len(trained)
    emit(
        "ledger_ok",
        int(ledger_ok),
        "bool",
        target=1,
        better="higher",
        epoch_counts=chaos["epoch_counts"],
        requeued=chaos["requeued"],
        replicas=chaos["events"],
    )
    if args.transport == "collective":
        emit_publishes(chaos["history"], args.sync_timeout)
    emit("wall_s", time.time() - start, "s", out=root, hardware=hardware(args.device))
    return account(chaos["plans"])


def emit_publishes(history: list[dict], timeout_s: float) -> None:
    """The longest weight publish of the run (a broadcast waiting for a lost replica
    shows here) and the versions replicas took from the object store instead."""
    publish = [row.get("timing_s/weight_publish", 0.0) for row in history]
    emit(
        "weight_publish_max_s",
        max(publish, default=0.0),
        "s",
        target=10.0,
        better="lower",
        median_s=statistics.median(publish) if publish else 0.0,
        timeout_s=timeout_s,
    )
    fallbacks = sum(row.get("async/weight_transport_fallbacks", 0) for row in history)
    emit("weight_transport_fallbacks", fallbacks, "versions")


def account(plans: dict[str, KillPlan]) -> int:
    """`kills_not_landed` (target 0): each planned kill that did not land, with its
    misses and why, also said on stderr; how many (the harness's run failed if any)."""
    not_landed = {name: plan.report()["not_landed"] for name, plan in plans.items()}
    missed = {name: plan.report()["missed"] for name, plan in plans.items()}
    count = sum(len(entries) for entries in not_landed.values())
    emit(
        "kills_not_landed",
        count,
        "kills",
        target=0,
        better="lower",
        not_landed=not_landed,
        missed=missed,
    )
    for name, plan in plans.items():
        for line in plan.lines():
            print(f"chaos: FAILED ({name}): {line}", file=sys.stderr)
    return count


def run(args: argparse.Namespace, out: str, kills: int) -> dict:
    """One run; with `kills`, under the chaos monkey. `error` says why it did not finish."""
    extra = AGENT if args.agent else []
    cfg = load_config("grpo", [*overrides(args.steps, out, args.model, args.device), *extra])
    training = Run(PPOTrainer(cfg, print_fn=lambda text: print(text, file=sys.stderr)))
    monkey, history, error = None, [], None
    try:
        training.setup()
        if kills:
            stages = args.stages.split(",")
            monkey = ChaosMonkey(training, seed=args.seed, stages=stages, kills=kills).start()
        history = training.fit()
    except Exception as err:  # noqa: BLE001 - a run that did not survive is a result here
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        if monkey is not None:
            monkey.stop()
        training.shutdown()
    plan = monkey.plan if monkey else KillPlan(kills)
    if error is not None:
        return {"error": error, "kills": monkey.done if monkey else [], "plan": plan}
    return {
        "history": history,
        "ledger": training.replay.ledger,
        "weights": final_weights(out),
        "kills": monkey.done if monkey else [],
        "plan": plan,
        "recovery_s": monkey.recovery_seconds() if monkey else [],
    }


RESULTS = sys.stdout  # the JSON lines only: main() sends every other print to stderr


emit = functools.partial(emit_line, BENCH, stream=RESULTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: the 2 ranks on 2 GPUs over NCCL (issue 14's recovery_s)",
    )
    parser.add_argument("--agent", action="store_true", help="multi-turn episodes with tools")
    parser.add_argument(
        "--stages",
        default=None,
        help=f"kill points, comma-separated, of {', '.join(POINTS)} (default: all; "
        "tools with --agent only)",
    )
    parser.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="an asynchronous run: training ranks and rollout replicas killed, the ledger checked",
    )
    parser.add_argument(
        "--transport",
        default="object_store",
        choices=["object_store", "collective"],
        help="--async: how versions reach the replicas (async_training.weight_transport)",
    )
    parser.add_argument(
        "--sync-timeout", type=float, default=120.0, help="collective: the broadcast's bound, s"
    )
    parser.add_argument(
        "--replica-kill-at",
        default="gen",
        choices=["gen", "any"],
        help="--async: kill a replica in the middle of generation, or at any moment of a step",
    )
    args = parser.parse_args()
    if args.transport == "collective" and not args.async_mode:
        parser.error("--transport collective is asynchronous training's: add --async")
    if not 0 <= args.kills <= args.steps:
        parser.error(f"--kills {args.kills}: at most one kill a step, so 0 to --steps {args.steps}")
    args.stages = args.stages or ",".join(POINTS if args.agent else DEFAULT_STAGES)
    root = args.out or tempfile.mkdtemp(prefix="rayrl-chaos-")
    # A tiny model, big enough that each stage (weight sync included) lasts long
    # enough for a kill to land inside it on CPU.
    args.model = str(
        build_tiny_model(f"{root}/model", layers=4, hidden=256, seed=0, overwrite=True)
    )
    if args.agent:
        end_turns_often(args.model, share=1 / 8)
    # Ray prints a notice per killed worker on the driver's stdout, from its own thread;
    # it goes to stderr so that stdout stays one JSON object a line.
    sys.stdout = sys.stderr
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    start = time.time()
    failed = (main_async if args.async_mode else main_sync)(args, root, start)
    ray.shutdown()
    if failed:
        sys.exit(f"chaos: {failed} planned kill(s) did not land (each named above, with why)")


def main_sync(args: argparse.Namespace, root: str, start: float) -> int:
    """A clean run and a killed one, compared; the planned kills that did not land."""
    clean = run(args, f"{root}/clean", kills=0)
    chaos = run(args, f"{root}/chaos", kills=args.kills)
    kills = chaos["kills"]
    emit(
        "kills",
        len(kills),
        "kills",
        planned=args.kills,
        stages=[k.stage for k in kills],
        steps=args.steps,
        missed=chaos["plan"].report()["missed"],
    )
    survived = 0 if "error" in chaos else len(kills)
    emit(
        "kills_survived",
        survived,
        "kills",
        target=args.kills,
        better="higher",
        error=chaos.get("error"),
    )
    failed = account({"training ranks": chaos["plan"]})
    if "error" in chaos or "error" in clean:
        return failed
    verdict, recovery = compare_runs(clean, chaos), chaos["recovery_s"]
    emit("weights_identical", int(verdict["weights_identical"]), "bool", target=1, better="higher")
    emit(
        "metrics_identical",
        int(verdict["metrics_identical"]),
        "bool",
        differ=verdict["metrics_differ"],
    )
    ledger_ok = verdict["ledger_identical"] and not verdict["trained_twice"]
    emit("ledger_ok", int(ledger_ok), "bool", trained_twice=verdict["trained_twice"])
    emit("recovery_p50_s", statistics.median(recovery) if recovery else None, "s")
    emit("recovery_max_s", max(recovery) if recovery else None, "s")
    emit(
        "recovery_s",
        statistics.median(recovery) if recovery else None,
        "s",
        runs=recovery,
        device=args.device,
        n_gpus=2 if args.device == "cuda" else 0,
    )
    steps = [m["timing_s/step"] for m in clean["history"]]
    snaps = [m["timing_s/snapshot"] for m in clean["history"]]
    emit(
        "snapshot_overhead_per_step_s",
        statistics.median(snaps),
        "s",
        target=0.05 * statistics.median(steps),
        better="lower",
    )
    fractions = [s / t for s, t in zip(snaps, steps, strict=True)]
    emit(
        "snapshot_overhead_fraction",
        statistics.median(fractions),
        "ratio",
        target=0.05,
        better="lower",
    )
    emit("wall_s", time.time() - start, "s", out=root, hardware=hardware(args.device))
    return failed


if __name__ == "__main__":
    main()

"""Asynchronous vs synchronous training on a long-tail workload, in interleaved rounds.

A long-tail workload: a tiny Qwen2 (random weights) whose end-of-sequence token is
made likely enough that response lengths spread widely (median far below the longest,
which reaches `--response-length`), so a synchronous step waits for its longest sample.
The same GRPO config runs in rounds, alternately:

- `sync`: the hybrid engine, generation and training in one process (`rollout.mode=sync`,
  as `rayrl train` runs it: the reward in the same process, whose bundle then holds two
  CPUs and trains on two threads);
- `sync1`: the same with the reward in a process of its own (`reward.colocate=false`),
  so that training runs on one thread as the async trainer's does: the comparison
  that isolates what overlapping generation with training gains;
- `async`: one rollout replica in a process of its own and one training process, a
  CPU each (`rollout.mode=async`, `async_training.staleness_threshold` 1 by default,
  without partial rollouts: verl's one-step-off-policy; the reward in a light process
  of its own, `reward.colocate=false`, so that the trainer's bundle is one CPU), the
  replica generating the next batch while the trainer trains.

Throughput is trained samples (prompts x rollout.n) per second of wall time from the
end of the first step to the end of the last, start-up and the first step left out.
Prints JSON lines: `sync_samples_per_s`, `sync1_samples_per_s` and
`async_samples_per_s` (medians over the rounds), `samples_per_s_ratio_vs_sync` (target
1.3) and `samples_per_s_ratio_vs_sync1`, and the async run's staleness, waits and idle
fractions. `--device cuda` puts both processes on one GPU, each on half
of it (`resources.gpus_per_worker=0.5`, `rollout.gpus_per_replica=0.5`), and the async
run keeps the reward in the trainer's process as the sync run does (the host has the
cores; `sync1` is then the same placement as `sync`'s but for the reward).

`--agent`: the long tail of agents. Each sample is a multi-turn episode (the random
model's turns end after about 1/`--turn-end` tokens, `_agent_env.end_turns_often`)
whose every turn is a tool call taking 20-500 ms (`--latency`, log-uniform per call)
for 0-6 calls an episode (`--calls`), seeded per episode
(`_agent_env.LatencyEnvironment`). The modes are then `sync` (the hybrid engine),
`async` (a replica, no partial rollouts: a new version waits for the calls that
began under the old one) and `async_partial` (in-flight weight updates: the replica
swaps a new version in between engine steps, episodes mid-turn go on under it), and
the ratios `agent_async_over_sync` (target 1.5: the better of the two async modes
over sync) and `agent_partial_over_async` (target 1.15).

Usage: `python bench/async_cpu.py [--rounds 2] [--steps 6] [--device cpu|cuda]
[--staleness 1] [--agent] [KEY=VALUE ...]` (overrides of every run).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import emit_line, hardware

BENCH = "async_cpu"
RESULTS = sys.stdout
AGENT_ENV = Path(__file__).resolve().parent / "_agent_env.py"


emit = functools.partial(emit_line, BENCH, stream=RESULTS)


def long_tail_model(out: Path, layers: int, hidden: int, eos_shift: float) -> str:
    """The tiny model with its end-of-sequence logit raised: every token's embedding
    gets one constant component (which the tied output head adds to every logit alike)
    and the EOS token a little more of it, so EOS gets likelier by a fixed amount."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models import build_tiny_model

    path = build_tiny_model(out, layers=layers, hidden=hidden, seed=0, overwrite=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] += 1.0
        embedding[tokenizer.eos_token_id, 0] += eos_shift
    model.save_pretrained(path)
    return str(path)


def overrides(args: argparse.Namespace, model: str, out: str) -> list[str]:
    cuda = args.device == "cuda"
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=32",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"trainer.device={args.device}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        "trainer.export_hf=false",
        "trainer.resume_mode=disable",
        f"trainer.output_dir={out}",
        "trainer.seed=0",
        *(["resources.gpus_per_worker=0.5", "rollout.gpus_per_replica=0.5"] if cuda else []),
        *(["actor_rollout_ref.rollout.gpu_memory_utilization=0.3"] if cuda else []),
        *args.overrides,
    ]


def agent_overrides(args: argparse.Namespace) -> list[str]:
    """Every sample an episode of tool calls of spread latency (module docstring)."""
    mt = "actor_rollout_ref.rollout.multi_turn"
    env = f"{mt}.environment_config"
    return [
        f"{mt}.enable=true",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_ENV}:LatencyEnvironment",
        f"{env}.latency_s=[{args.latency[0]},{args.latency[1]}]",
        f"{env}.calls=[{args.calls[0]},{args.calls[1]}]",
        f"{mt}.max_tool_response_length=8",
        f"{mt}.max_concurrent_tools={args.batch * args.n * 2}",
    ]


def async_overrides(args: argparse.Namespace, partial: bool | None = None) -> list[str]:
    partial = args.partial if partial is None else partial
    return [
        "actor_rollout_ref.rollout.mode=async",
        "rollout.n_gpus_per_node=1",
        f"async_training.staleness_threshold={args.staleness}",
        "async_training.trigger_parameter_sync_step=1",
        f"async_training.partial_rollout={str(partial).lower()}",
        *(
            [f"async_training.prompts_per_call={args.prompts_per_call}"]
            if args.prompts_per_call
            else []
        ),
        # on CPU one core each: the reward in a light process of its own, so the
        # trainer's bundle (and its torch threads) is one CPU beside the replica's one;
        # on a GPU the reward stays in the trainer's process, as in the sync run
        *(["reward.colocate=false"] if args.device == "cpu" else []),
    ]


def one_run(args: argparse.Namespace, mode: str, out: str) -> dict:
    """A run of `args.steps` steps; its trained samples per second after the first step."""
    from rayrl.config import load_config
    from rayrl.trainer.async_ppo import AsyncPPOTrainer
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    extra = {
        "async": async_overrides(args, None if not args.agent else False),
        "async_partial": async_overrides(args, True),
        "sync1": ["reward.colocate=false"],
    }.get(mode, [])
    agent = agent_overrides(args) if args.agent else []
    cfg = load_config("grpo", [*overrides(args, args.model, out), *agent, *extra])
    cls = AsyncPPOTrainer if mode.startswith("async") else PPOTrainer
    run = Run(cls(cfg, print_fn=lambda text: print(text, file=sys.stderr)))
    ends: list[float] = []
    try:
        run.setup()
        history = run.fit(on_step=lambda step, metrics: ends.append(time.perf_counter()))
    finally:
        run.shutdown()
    samples = args.batch * args.n * (len(ends) - 1)
    return {"samples_per_s": samples / (ends[-1] - ends[0]), "history": history[1:]}


def agent_results(runs: dict, rates: dict, setup: dict) -> None:
    """The agent workload's lines: each mode's samples/s and the two ratios."""
    median = {mode: statistics.median(values) for mode, values in rates.items()}
    for mode, value in median.items():
        emit(f"agent_{mode}_samples_per_s", value, "samples/s", per_round=rates[mode], **setup)
    best = max(median["async"], median["async_partial"])
    emit(
        "agent_async_over_sync",
        best / median["sync"],
        "ratio",
        target=1.5,
        better="higher",
        **setup,
    )
    emit(
        "agent_partial_over_async",
        median["async_partial"] / median["async"],
        "ratio",
        target=1.15,
        better="higher",
        **setup,
    )
    for mode in runs:
        history = [m for r in runs[mode] for m in r["history"]]
        for key, unit in (
            ("multi_turn/num_turns/mean", "turns"),
            ("response_length/mean", "tokens"),
            ("timing_s/gen", "s"),
            ("timing_s/wait_for_batch", "s"),
            ("perf/rollout_idle_fraction", "fraction"),
            ("async/staleness/mean", "steps"),
            ("async/requeued", "prompts"),
        ):
            if any(key in m for m in history):
                emit(key.replace("/", "_"), mean_of(history, key), unit, run=mode)


def mean_of(history: list[dict], key: str) -> float:
    values = [m[key] for m in history if key in m]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    global RESULTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--eos-shift", type=float, default=0.3)
    parser.add_argument("--staleness", type=float, default=1.0)
    parser.add_argument("--partial", action="store_true", help="partial rollouts on")
    parser.add_argument(
        "--prompts-per-call",
        type=int,
        default=0,
        help="async: prompts per replica call (0: the whole batch in one call)",
    )
    parser.add_argument("--agent", action="store_true", help="the long tail of agents")
    parser.add_argument("--latency", type=float, nargs=2, default=[0.02, 0.5])
    parser.add_argument("--calls", type=int, nargs=2, default=[0, 6])
    parser.add_argument("--turn-end", type=float, default=1 / 12, help="agents: EOS share")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None, help="an HF model directory to use instead")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of both runs")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="rayrl-async-"))
    args.model = args.model or long_tail_model(
        root / "model", args.layers, args.hidden, args.eos_shift
    )
    if args.agent:
        sys.path.insert(0, str(AGENT_ENV.parent))
        from _agent_env import end_turns_often

        end_turns_often(args.model, args.turn_end)
    RESULTS, sys.stdout = sys.stdout, sys.stderr  # worker noise away from the JSON lines
    import ray

    gpus = {"num_gpus": 1} if args.device == "cuda" else {}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, **gpus)
    modes = ("sync", "async", "async_partial") if args.agent else ("sync", "sync1", "async")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in runs:
            result = one_run(args, mode, str(root / f"{mode}{round_}"))
            runs[mode].append(result)
            print(
                f"round {round_} {mode}: {result['samples_per_s']:.2f} samples/s", file=sys.stderr
            )
    ray.shutdown()
    setup = {
        "device": args.device,
        "hardware": hardware(args.device),
        "rounds": args.rounds,
        "steps": args.steps,
        "batch": args.batch,
        "n": args.n,
        "response_length": args.response_length,
        "staleness": args.staleness,
        "partial_rollout": args.partial,
        "prompts_per_call": args.prompts_per_call,
        "agent": args.agent,
        **({"latency_s": args.latency, "calls": args.calls} if args.agent else {}),
    }
    rates = {mode: [r["samples_per_s"] for r in done] for mode, done in runs.items()}
    if args.agent:
        agent_results(runs, rates, setup)
        return
    sync, fast = statistics.median(rates["sync"]), statistics.median(rates["async"])
    emit("sync_samples_per_s", sync, "samples/s", per_round=rates["sync"], **setup)
    emit("async_samples_per_s", fast, "samples/s", per_round=rates["async"], **setup)
    emit("samples_per_s_ratio_vs_sync", fast / sync, "ratio", target=1.3, better="higher", **setup)
    one = statistics.median(rates["sync1"])
    emit("sync1_samples_per_s", one, "samples/s", per_round=rates["sync1"], **setup)
    emit("samples_per_s_ratio_vs_sync1", fast / one, "ratio", better="higher", **setup)
    history = [m for r in runs["async"] for m in r["history"]]
    sync_history = [m for r in runs["sync"] for m in r["history"]]
    sync1_history = [m for r in runs["sync1"] for m in r["history"]]
    emit("response_length_mean", mean_of(sync_history, "response_length/mean"), "tokens")
    emit("sync_gen_s", mean_of(sync_history, "timing_s/gen"), "s", run="sync")
    emit("sync_update_actor_s", mean_of(sync_history, "timing_s/update_actor"), "s", run="sync")
    emit("sync1_gen_s", mean_of(sync1_history, "timing_s/gen"), "s", run="sync1")
    emit("sync1_update_actor_s", mean_of(sync1_history, "timing_s/update_actor"), "s", run="sync1")
    emit("async_update_actor_s", mean_of(history, "timing_s/update_actor"), "s", run="async")
    emit("response_length_clip_ratio", mean_of(sync_history, "response_length/clip_ratio"), "")
    for key, unit in (
        ("async/staleness/mean", "steps"),
        ("async/dropped", "prompts"),
        ("timing_s/wait_for_batch", "s"),
        ("perf/train_idle_fraction", "fraction"),
        ("perf/rollout_idle_fraction", "fraction"),
        ("async/weight_sync_ms", "ms"),
        ("async/rollout_call_s", "s"),
    ):
        emit(key.replace("/", "_"), mean_of(history, key), unit, run="async")


if __name__ == "__main__":
    main()

"""Host time per step of the native engine's multi-turn rollout (workload M) on the CPU.

Workload M's steps on a GPU cost far more than single-turn decoding's (issue 23). With a
tiny model on the CPU the forward is cheap, so what the engine's loop does besides
the forward, and what tool threads take from it, shows up plainly. This runs
workload M's episodes (`bench/rollout_agent.py`: every turn end a tool call of
``--latency`` seconds through the real `MultiTurnRollout`, up to ``--calls`` calls)
on many samples at once, then single-turn decoding of the same tokens, on one engine,
one torch thread, and reports for each (JSON lines, ``bench: agent_host``; of
``--repeats`` timed runs after a warm-up, the one with the least host time per step):

- ``step_ms``: the rollout's wall time, less the time it waited on tools with nothing
  to run (``turn_wait_s``), per step (prefill and decode);
- ``forward_ms`` / ``sample_ms``: the model's forward and the token draw per step;
- ``host_ms``: the rest per step: scheduling, inputs, bookkeeping, turn handling,
  and time the loop's thread waited for the GIL;
- ``loop_cpu_ms``: CPU time of the loop's thread per step (forward included), so
  ``step_ms - loop_cpu_ms`` is time that thread spent not running (the GIL, the OS);
- ``host_cpu_ms``: CPU time of the loop's thread outside the forwards and draws, per
  step: its own host work, which CPU load from other processes barely changes (the
  wall-time figures above do change with it);
- ``other_threads_cpu_ms``: CPU time of the process's other threads (tools, the turn
  driver), per step of the loop: Python work there competes for the GIL; also per
  resumed turn (``other_threads_cpu_us_per_turn``);
- ``decode_forward_ms`` / ``prefill_forward_ms``: a decode / prefill step's forward;
- ``decode_batch``: mean samples per decode step;
- ``engine_stats``: the engine's ``last_stats`` of that run (where its loop's time went:
  ``prefill_s``, ``launch_s``, ``commit_s``, ``turns_s``, ``turn_wait_s``).

``--profile`` adds the loop thread's top functions (cProfile, own time per step) in the
multi-turn rollout. Other threads (tools, the turn driver) are not profiled: their
cost to the loop is ``step_ms - loop_cpu_ms``.

    PYTHONPATH=src:bench python bench/agent_host.py [--prompts 256] [--response 96]
        [--eos-share 0.0625] [--calls 4] [--latency 0.05] [--repeats 3] [--profile] [--top 20]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from _agent_env import LatencyEnvironment
from _common import hardware
from rayrl.config.multi_turn import MultiTurnConfig
from rayrl.models.tiny import TinySpec
from rayrl.models.tokenizer import train_tokenizer
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.agent.rollout import MultiTurnRollout
from rollout_agent import _prompts, host_profile


class StepClock:
    """Times the engine's forwards (prefill and decode apart) and token draws, in wall
    time and in CPU time of the loop's thread."""

    def __init__(self, engine: NativeRolloutEngine) -> None:
        self.reset()
        model, sampler = engine.runner.model, engine.runner.sampler
        forward, draw = model.forward, sampler.draw
        self._owner = threading.get_ident()

        def timed_forward(step, cache):
            start = time.perf_counter(), time.thread_time()
            try:
                return forward(step, cache)
            finally:
                self._add("decode" if step.decode else "prefill", start)

        def timed_draw(*args, **kwargs):
            start = time.perf_counter(), time.thread_time()
            try:
                return draw(*args, **kwargs)
            finally:
                self._add("sample", start)

        model.forward, sampler.draw = timed_forward, timed_draw

    def _add(self, kind: str, start: tuple[float, float]) -> None:
        if threading.get_ident() == self._owner:
            self.seconds[kind] += time.perf_counter() - start[0]
            self.cpu_s += time.thread_time() - start[1]

    def reset(self) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0, "sample": 0.0}
        self.cpu_s = 0.0


def build(args) -> tuple[NativeRolloutEngine, StepClock]:
    from transformers import Qwen2ForCausalLM

    spec = TinySpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(spec.to_config()).float().eval()
    vocab = model.config.vocab_size
    model.generation_config.eos_token_id = list(range(3, vocab, round(1 / args.eos_share)))
    length = args.prompt + args.response
    engine = NativeRolloutEngine(
        model=model,
        tokenizer=train_tokenizer(model_max_length=length),
        device="cpu",
        max_num_seqs=args.prompts,
        max_model_len=length,
        cpu_cache_tokens=2 * args.prompts * length,
    )
    return engine, StepClock(engine)


def measure(
    engine: NativeRolloutEngine, clock: StepClock, run: Callable[[], object], repeats: int
) -> dict:
    """Run once to warm up, then ``repeats`` times timed; the per-step figures of the
    timed run with the least host time per step (the machine's other load adds noise)."""
    run()
    runs = [_timed_run(engine, clock, run) for _ in range(repeats)]
    return min(runs, key=lambda r: r["host_ms"])


def _timed_run(engine: NativeRolloutEngine, clock: StepClock, run: Callable[[], object]) -> dict:
    clock.reset()
    cpu, process, start = time.thread_time(), time.process_time(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    others = time.process_time() - process - cpu
    stats = engine.last_stats
    steps = stats["prefill_steps"] + stats["decode_steps"]
    busy = stats["run_s"] - stats.get("turn_wait_s", 0.0)
    seconds = clock.seconds
    host = busy - sum(seconds.values())
    per_step = 1000.0 / steps
    return {
        "seconds": round(wall, 3),
        "steps": steps,
        "decode_steps": stats["decode_steps"],
        "prefill_steps": stats["prefill_steps"],
        "turn_wait_s": round(stats.get("turn_wait_s", 0.0), 3),
        "step_ms": round(busy * per_step, 3),
        "forward_ms": round((seconds["prefill"] + seconds["decode"]) * per_step, 3),
        "decode_forward_ms": round(1000 * seconds["decode"] / max(stats["decode_steps"], 1), 3),
        "prefill_forward_ms": round(1000 * seconds["prefill"] / max(stats["prefill_steps"], 1), 3),
        "sample_ms": round(seconds["sample"] * per_step, 3),
        "host_ms": round(host * per_step, 3),
        "loop_cpu_ms": round((cpu - stats.get("turn_wait_s", 0.0)) * per_step, 3),
        "host_cpu_ms": round((cpu - clock.cpu_s) * per_step, 3),
        "other_threads_cpu_ms": round(others * per_step, 3),
        "other_threads_cpu_us_per_turn": round(
            1e6 * others / max(stats.get("resumed_turns", 0), 1), 1
        ),
        "engine_stats": stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--response", type=int, default=96, help="response tokens at most")
    parser.add_argument("--eos-share", type=float, default=1 / 16, help="EOS ids' vocab share")
    parser.add_argument("--calls", type=int, default=4, help="tool calls per episode at most")
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per tool call")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (the best is kept)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the loop thread's CPU time then includes the forward
    engine, clock = build(args)
    config = MultiTurnConfig(
        environment_config={"latency_s": args.latency, "calls": args.calls},
        max_concurrent_tools=args.prompts,
    )
    rollout = MultiTurnRollout(engine, [], config, environment=LatencyEnvironment)
    shape = {"n": args.prompts, "prompt": args.prompt}
    prompts = _prompts(shape, engine.spec.vocab)
    sampling = SamplingParams(max_new_tokens=args.response, seed=1)
    base = {
        "bench": "agent_host",
        "hardware": hardware("cpu"),
        "date": datetime.date.today().isoformat(),
        "prompts": args.prompts,
        "response": args.response,
        "tool_latency_s": args.latency,
        "max_tool_calls": args.calls,
    }
    records = []
    out = {}

    def multi():
        out["batch"] = rollout.generate(prompts, sampling)

    multi_turn = measure(engine, clock, multi, args.repeats)
    sampled = out["batch"]["response_mask"].sum(-1).numpy().astype(np.int64)
    records.append({**base, "mode": "multi_turn", **multi_turn})
    rows = [
        p[m.bool()].tolist()
        for p, m in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
    ]
    flat = SamplingParams(max_new_tokens=int(sampled.max()), ignore_eos=True, seed=1)
    single = measure(
        engine,
        clock,
        lambda: engine.generate_token_ids(rows, flat, max_new_tokens=sampled),
        args.repeats,
    )
    records.append({**base, "mode": "single_turn", **single})
    for record in records:
        stats = record["engine_stats"]
        record["decode_batch"] = round(float(sampled.sum()) / max(stats["decode_steps"], 1), 1)
        record["sampled_tokens"] = int(sampled.sum())
    if args.profile:
        steps = lambda: engine.last_stats["prefill_steps"] + engine.last_stats["decode_steps"]  # noqa: E731
        records.append(
            {**base, "mode": "multi_turn_profile", "top": host_profile(multi, steps, args.top)}
        )
    with open(args.out, "a") if args.out else io.StringIO() as sink:
        for record in records:
            line = json.dumps(record)
            print(line, flush=True)
            sink.write(line + "\n")


if __name__ == "__main__":
    main()

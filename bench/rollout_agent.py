"""The multi-turn workload of `bench/rollout.py` (``--workloads M``): agent episodes with
tools on the native engine through the rollout service (`RolloutService`, as both
rollout workers run them), against single-turn decoding of the same tokens.

256 prompts of 256 random token ids (tiny shape: 8 of 16); a random model's turn ends
at an EOS id, a 1/64 share of its vocabulary (tiny: 1/8), so turns last about 64
tokens (8); every turn end is a tool call of 50 ms (`bench/_agent_env.py`'s
`LatencyEnvironment`, through the real `MultiTurnRollout`: parked samples, observation
tokens appended in the chat format, continued with a prefill onto their own KV cache)
and up to 4 calls per episode, in a response of at most 512 tokens (tiny: 64), sampled
and appended together. The same engine then decodes, single-turn and ignoring EOS, as
many tokens per row as each episode sampled.

Records (JSON lines, `workload: M`): `tokens_per_s` (sampled tokens of the episodes
per second of the multi-turn rollout), `single_turn_tokens_per_s` (the same tokens per
row in one turn, no tools), `multi_turn_vs_single_turn` (their ratio; target 0.7),
and `busy_fraction_during_tools`: of the moments when some tool ran (sampled every
5 ms), the share in which the engine was decoding (its committed-token count moved),
and on CUDA also NVML's GPU utilisation averaged over those moments, read every 50 ms
(NVML's own sample period is longer) through one NVML handle
(`gpu_utilization_during_tools`). The probe is a thread of the engine's process, so
it is kept cheap: `torch.cuda.utilization()` re-initialises NVML and looks the device
up at every call, Python work that takes the GIL from the engine's loop.
The `tokens_per_s` record also holds the engine's `last_stats` (where its loop's time
went: `prefill_s`, of it `prefill_forward_s` (queueing the eager prefill forwards)
and `prefill_wait_s` (waiting for their first tokens), `launch_s`, `commit_s`,
`turns_s`, `turn_wait_s`, `wait_s`; `graph_captures` in the timed run), and the CPU time of the loop's thread
(`loop_cpu_s`) and of the process's other threads (`other_threads_cpu_s`: tools, the
turn driver, the probe) during the rollout: a loop whose CPU time falls well short of
`run_s - wait_s - turn_wait_s` was waiting for the GIL. ``--host-profile`` (of
`bench/rollout.py`) runs the episodes once more under cProfile and records the loop
thread's top functions by own time per step (`host_profile`; cProfile slows Python
code, so the shares matter, not the absolute times).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from _agent_env import LatencyEnvironment
from _common import cold_prefix, seqs_limit
from rayrl import progress
from rayrl.batch import Batch
from rayrl.config.multi_turn import MultiTurnConfig
from rayrl.models.tokenizer import train_tokenizer
from rayrl.rollout import NativeRolloutEngine, SamplingParams, positions_from_mask
from rayrl.rollout.agent.rollout import MultiTurnRollout
from rayrl.rollout.service import RolloutService

TOOL_LATENCY_S = 0.05
MAX_CALLS = 4
TARGET_RATIO = 0.7


def shape_of(shape: str) -> dict:
    if shape == "tiny":
        return {"n": 8, "prompt": 16, "response": 64, "eos_share": 1 / 8}
    return {"n": 256, "prompt": 256, "response": 512, "eos_share": 1 / 64}


class BusyProbe:
    """Samples, every `period_s`, whether a tool runs (the `tools` progress phase the
    multi-turn driver sets) and whether the engine moved since the last sample."""

    def __init__(self, cuda: bool, period_s: float = 0.005, util_every: int = 10) -> None:
        self.cuda, self.period_s, self.util_every = cuda, period_s, util_every
        self.tool_samples, self.busy_samples, self.gpu_util = 0, 0, []
        self._nvml = NvmlUtilization() if cuda else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> BusyProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        last = progress.state()["counts"].get("tokens", 0)
        while not self._stop.wait(self.period_s):
            state = progress.state()
            tokens = state["counts"].get("tokens", 0)
            if state["phase"] == "tools":
                self.tool_samples += 1
                self.busy_samples += tokens != last
                if self._nvml is not None and self.tool_samples % self.util_every == 1:
                    self.gpu_util.append(self._nvml.read())
            last = tokens

    def fractions(self) -> tuple[float | None, float | None]:
        busy = self.busy_samples / self.tool_samples if self.tool_samples else None
        util = [u for u in self.gpu_util if u is not None]
        return busy, (sum(util) / len(util) / 100 if util else None)


class NvmlUtilization:
    """NVML's utilisation of the current CUDA device through one handle, found once
    (by the device's UUID, else by its index); `read` is None when NVML (pynvml) is
    not there."""

    def __init__(self) -> None:
        self._nvml, self._handle = None, None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - NVML missing: no utilisation figure
            return
        device = torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid.removeprefix('GPU-')}")
        except Exception:  # noqa: BLE001 - no UUID: the index (no CUDA_VISIBLE_DEVICES remap)
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            except Exception:  # noqa: BLE001
                return
        self._nvml = pynvml

    def read(self) -> float | None:
        if self._nvml is None:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:  # noqa: BLE001
            return None


def run_multi_turn(model, args, base: dict, emit) -> None:
    """The M workload on the native engine; records through `emit`."""
    s = shape_of(args.shape)
    vocab = model.config.vocab_size
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = list(range(3, vocab, round(1 / s["eos_share"])))
    try:
        _episodes(model, args, base, emit, s)
    finally:
        model.generation_config.eos_token_id = eos


def _episodes(model, args, base: dict, emit, s: dict) -> None:
    vocab = model.config.vocab_size
    tokenizer = train_tokenizer(model_max_length=s["prompt"] + s["response"])
    engine = NativeRolloutEngine(
        model=model,
        tokenizer=tokenizer,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=seqs_limit(args, "M"),
        max_model_len=s["prompt"] + s["response"],
        **_resume_options(args),
    )
    config = MultiTurnConfig(
        environment_config={"latency_s": TOOL_LATENCY_S, "calls": MAX_CALLS},
        max_concurrent_tools=s["n"],
    )
    runner = MultiTurnRollout(engine, [], config, environment=LatencyEnvironment)
    service = RolloutService(engine, runner)  # the object both rollout workers hold
    prompts = _prompts(s, vocab)
    sampling = SamplingParams(max_new_tokens=s["response"], seed=1)
    service.generate(prompts, sampling)  # warm-up: kernels tuned, graphs captured
    cold_prefix(engine, args)
    with BusyProbe(args.device == "cuda") as probe:
        cpu, process, threads = time.thread_time(), time.process_time(), threads_cpu()
        seconds, out = _timed(lambda: service.generate(prompts, sampling).batch, args.device)
        cpu, process = time.thread_time() - cpu, time.process_time() - process
        threads = cpu_by_name(threads, threads_cpu())
    multi_stats = dict(engine.last_stats)  # the multi-turn call's, not the single-turn one's
    sampled = out["response_mask"].sum(-1).numpy().astype(np.int64)
    calls = float(np.mean([sum(m["role"] == "tool" for m in t) for t in out["trajectory"]]))
    turns = float(np.mean(out["num_turns"]))
    rows = [
        p[m.bool()].tolist()
        for p, m in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
    ]
    flat = SamplingParams(max_new_tokens=int(sampled.max()), ignore_eos=True, seed=1)
    engine.generate_token_ids(rows, flat, max_new_tokens=sampled)  # warm-up
    cold_prefix(engine, args)
    single_s, _ = _timed(
        lambda: engine.generate_token_ids(rows, flat, max_new_tokens=sampled), args.device
    )
    rate, single = sampled.sum() / seconds, sampled.sum() / single_s
    busy, util = probe.fractions()
    extra = {
        **base,
        "workload": "M",
        "engine": "native",
        "tool_latency_s": TOOL_LATENCY_S,
        "max_tool_calls": MAX_CALLS,
    }
    emit(
        {
            **extra,
            "metric": "tokens_per_s",
            "value": round(float(rate), 1),
            "unit": "tokens/s",
            "sampled_tokens": int(sampled.sum()),
            "seconds": round(seconds, 3),
            "num_turns_mean": round(turns, 2),
            "tool_seconds": round(runner.last_stats["timing_s/tools"], 3),
            "tool_calls_mean": round(calls, 2),
            "resume_prefill_cost": engine.resume_prefill_cost,
            "prefill_graph_tokens": engine.prefill_graph_tokens * engine.use_prefill_graphs,
            **multi_stats,
            "loop_cpu_s": round(cpu, 3),
            "other_threads_cpu_s": round(process - cpu, 3),
            "threads_cpu_s": threads,
            "switch_interval_s": sys.getswitchinterval(),
        }
    )
    emit(
        {
            **extra,
            "metric": "single_turn_tokens_per_s",
            "value": round(float(single), 1),
            "unit": "tokens/s",
            "seconds": round(single_s, 3),
        }
    )
    emit(
        {
            **extra,
            "metric": "multi_turn_vs_single_turn",
            "value": round(float(rate / single), 3),
            "unit": "ratio",
            "target": TARGET_RATIO,
            "better": "higher",
        }
    )
    emit(
        {
            **extra,
            "metric": "busy_fraction_during_tools",
            "value": None if busy is None else round(busy, 3),
            "unit": "fraction",
            "samples": probe.tool_samples,
            "measure": "engine committed tokens",
        }
    )
    if args.device == "cuda":
        emit(
            {
                **extra,
                "metric": "gpu_utilization_during_tools",
                "value": None if util is None else round(util, 3),
                "unit": "fraction",
                "measure": "NVML utilization, read every 50 ms while a tool ran",
            }
        )
    if getattr(args, "host_profile", False):  # one more rollout, under cProfile
        steps = lambda: engine.last_stats["prefill_steps"] + engine.last_stats["decode_steps"]  # noqa: E731
        top = host_profile(lambda: service.generate(prompts, sampling), steps, 25)
        emit({**extra, "metric": "host_profile", "value": None, "unit": "ms/step", "top": top})
    engine.sleep()


def threads_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of this process: {native id: (name,
    seconds)}; Python threads by their names, the others (CUDA's, torch's) as
    ``native``. Linux only (empty elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid), "native")
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_name(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two `threads_cpu` readings, summed by thread name (a
    thread that ended in between is not counted)."""
    totals: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        name = "rayrl-tool-worker" if name.startswith("rayrl-tool-worker") else name
        spent = seconds - before.get(tid, (name, 0.0))[1]
        totals[name] = round(totals.get(name, 0.0) + spent, 3)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def host_profile(run: Callable[[], object], steps_of: Callable[[], int], top: int) -> list[dict]:
    """The loop thread's functions with the most own time in ``run()``, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    steps = steps_of()
    rows = []
    for (path, line, name), (_, calls, own, total, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{path.rsplit('/', 2)[-1]}:{line}({name})",
                "calls_per_step": round(calls / steps, 2),
                "own_ms_per_step": round(1000 * own / steps, 4),
                "total_ms_per_step": round(1000 * total / steps, 4),
            }
        )
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top]


def _resume_options(args) -> dict:
    """The engine options of the command line that were given (the others: defaults)."""
    names = ("resume_prefill_cost", "prefill_graph_tokens")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _prompts(s: dict, vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(10, vocab, (s["n"], s["prompt"]))).long()
    mask = torch.ones_like(ids)
    uids = [f"m{i}" for i in range(s["n"])]
    columns = {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}
    return Batch.from_dict({**columns, "uid": uids}, meta={"step": 0})


def _timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out

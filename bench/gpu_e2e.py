"""GPU end-to-end benchmark: rayrl's GRPO against TRL's GRPOTrainer doing the same work.

Both systems train the same model (the Qwen2.5-0.5B-shaped random model by default,
or after ``--sft-steps`` of next-token training, where random weights give a system
NaN gradients) on the same prompts (synthetic arithmetic questions padded to exactly
``--prompt-len`` tokens after the chat template), group size ``--group``, responses of
``--response-len`` tokens (TRL: ``min_new_tokens``; rayrl: ``rollout.ignore_eos``; the
mean response length is reported), one AdamW step per
training step with the same settings (constant LR, no weight decay, clipping at 1),
no KL term (TRL's default beta 0), no activation checkpointing, no vLLM. TRL 1.16 has
no ``max_prompt_length``: the prompts are already exactly that long. For each system and
each ``--seqs`` (sequences per step) it reports, after ``--warmup`` steps:

* ``step_s`` (median; rayrl: with ``per_step``, each measured step's time),
  ``tokens_per_s_per_gpu`` (prompt + response tokens / step time),
* ``stage_s`` per stage (rayrl: gen, reward, adv, old_log_prob, ref, update_actor, weight_sync, snapshot,
  and parts of gen: graph_capture, rollout_wake, rollout_sleep; rayrl generates with
  ``--rollout``, by default its native engine on a GPU; rayrl's with ``per_step``),
* ``actor_mfu`` (rayrl's ``perf/mfu/actor``), ``weight_sync_ms``,
* ``peak_mem_gb`` (``model`` field: 0.5b, 7b), ``grad_norm_finite`` (1: every step's
  gradient norm was finite and no update was skipped),
* ``speedup_vs_trl`` (rayrl over TRL tokens/s) where both ran,
* rayrl on a GPU: ``roofline_step_s`` (the same step with generation at the decode
  roofline and training at the dense bf16 peak, `bench/roofline.py`) and
  ``step_vs_roofline`` (``step_s`` over it; target 2.0), and ``step_vs_roofline_shared``
  over the same roofline with each prompt trained once for its ``--group`` rows (what
  `model.share_prompts` runs).

``--memory-7b`` adds GRPO steps of a Qwen2.5-7B-shaped random model (bf16 weights
drawn on the GPU and written straight to safetensors) through the same product path,
with the memory features on: activation checkpointing, the actor's Adam moments
offloaded to host memory (the optimizer step brings them a slice at a time), a bf16
reference offloaded too, the native rollout at ``--gpu-mem-7b`` of the GPU, the KL
loss; ``--seqs-7b`` sequences per step; no HF export at the end (the GPU machine's
disk holds the model and the checkpoint, not a third copy). The actor's weights
(``--master-dtype-7b``, bf16 by default, moments alike) stay on the GPU by default
(``--actor-offload-7b 1`` offloads them too): on a host of 128 GiB, 30 GB of fp32
weights next to 60 GB of fp32 moments and the 15 GB reference left too little (the run
with all three offloaded lost its actor process in the first update, host memory at
103 of 125 GiB and rising; 2026-12-01). Its peak GPU memory (over every step) is
``peak_mem_gb`` with ``model`` 7b, with the step time and stage breakdown in the same
line (92.7 GiB, 17.8 s a step on one H200, 2026-12-01).

Every line is also appended to ``--out`` (default bench/results/gpu_e2e-<date>.jsonl).
TRL runs in its own process; it needs ``trl`` and ``datasets`` (a bench-only extra).

    python bench/gpu_e2e.py [--systems rayrl,trl] [--seqs 64,512] [--steps 3]
        [--warmup 1] [--prompt-len 256] [--response-len 256] [--group 8]
        [--preset qwen2.5-0.5b|tiny] [--sft-steps 0] [--memory-7b] [--device cuda]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_e2e_report import lines_for, roofline_of
from roofline import resolve_card

BENCH = "gpu_e2e"
STAGES = (
    "gen",
    "reward",
    "adv",
    "old_log_prob",
    "ref",
    "update_actor",
    "weight_sync",
    "snapshot",
    "graph_capture",
    "rollout_wake",
    "rollout_sleep",
)


# ------------------------------------------------------------------ model and data
def build_model(args: argparse.Namespace, workdir: Path) -> Path:
    """The benchmark model (random weights, optionally briefly SFT-trained); reused from
    ``--model-dir`` when that holds one."""
    from rayrl.models.tiny import preset

    if args.model_dir and (Path(args.model_dir) / "config.json").is_file():
        return Path(args.model_dir)
    spec = preset(args.preset, max_position=max(2048, args.prompt_len + args.response_len))
    path = spec.build(Path(args.model_dir) if args.model_dir else workdir / "model")
    if args.sft_steps:
        sft(path, args)
    return path


def sft(path: Path, args: argparse.Namespace) -> None:
    """A few next-token steps on the task's prompts and answers, saved in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = make_rows(tok, 64, args.prompt_len)
    for step in range(args.sft_steps):
        row = rows[step % len(rows)]
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tok(text + row["reward_model"]["ground_truth"], return_tensors="pt").input_ids
        loss = model(input_ids=ids.to(args.device), labels=ids.to(args.device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16).save_pretrained(path)


def make_rows(tokenizer, count: int, prompt_len: int) -> list[dict]:
    """Arithmetic rows whose chat-templated prompt is ``prompt_len`` tokens, counted as
    rayrl's dataset counts them (padding text appended to the question)."""
    from rayrl.data import synthetic_rows

    def length(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = synthetic_rows("arithmetic", count, seed=0)
    for row in rows:
        message = row["prompt"][0]
        base, pad = message["content"], 0
        while length(row["prompt"]) < prompt_len:
            pad += max(1, (prompt_len - length(row["prompt"])) // 2)
            message["content"] = base + " 0" * pad
        while length(row["prompt"]) > prompt_len and len(message["content"]) > len(base):
            message["content"] = message["content"][:-1]
    return rows


# ----------------------------------------------------------------------- rayrl
def run_rayrl(
    args: argparse.Namespace,
    model_dir: Path,
    rows: list[dict],
    seqs: int,
    extra: tuple[str, ...] = (),
    keep_warmup: bool = False,
    history_to: list | None = None,
) -> dict:
    """rayrl's GRPO through the product path (`PPOTrainer`); per-step metrics (with
    ``extra`` overrides last; ``keep_warmup``: the peak memory over warm-up steps too;
    ``history_to``: a list that gets every step's metrics, warm-up included)."""
    import ray

    from rayrl.config.load import load_config
    from rayrl.data.dataset import write_parquet
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    prompts = seqs // args.group
    with tempfile.TemporaryDirectory() as tmp:
        data = write_parquet(rows, Path(tmp) / "train.parquet")
        overrides = [
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files=[{data}]",
            f"data.train_batch_size={prompts}",
            f"data.max_prompt_length={args.prompt_len}",
            f"data.max_response_length={args.response_len}",
            "data.shuffle=false",
            f"actor_rollout_ref.rollout.n={args.group}",
            f"actor_rollout_ref.rollout.name={args.rollout or ('native' if args.device == 'cuda' else 'hf')}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_tokens}",
            # one GPU: FSDP2 bf16 compute, the faster set-up at 32,768 tokens per micro-batch
            f"actor_rollout_ref.actor.fsdp_config.wrap_one_gpu={args.max_tokens >= 32768}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",  # as TRL's default
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.logprob_micro}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.logprob_micro}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.rollout.ignore_eos=true",  # TRL's min_new_tokens: equal work
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",  # the same AdamW as TRL's run
            "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
            "actor_rollout_ref.actor.optim.clip_grad=1.0",
            "algorithm.adv_estimator=grpo",
            f"trainer.device={args.device}",
            "trainer.nnodes=1",
            f"trainer.n_gpus_per_node={getattr(args, 'gpus', 1)}",
            f"trainer.total_training_steps={args.warmup + args.steps}",
            f"trainer.output_dir={tmp}/out",
            *extra,
            *getattr(args, "set", []),
        ]
        if args.worker_logs and not ray.is_initialized():  # worker warnings on this console
            ray.init(address="local", include_dashboard=False, log_to_driver=True)
        run = Run(PPOTrainer(load_config(None, overrides)))
        try:
            history = run.setup().fit()
        finally:
            run.shutdown()
    if history_to is not None:
        history_to.extend(history)
    summary = summarize_rayrl(history[args.warmup :])
    if keep_warmup:
        summary["peak_mem_gb"] = summarize_rayrl(history)["peak_mem_gb"]
    return summary


def summarize_rayrl(steps: list[dict]) -> dict:
    def med(key: str) -> float | None:
        values = [s[key] for s in steps if key in s and s[key] is not None]
        return statistics.median(values) if values else None

    def each(key: str) -> list[float]:
        return [round(s[key], 4) for s in steps if s.get(key) is not None]

    norms = [s.get("actor/grad_norm", float("nan")) for s in steps]
    return {
        "step_s": med("timing_s/step"),
        "tokens_per_s": med("perf/throughput"),
        "stages": {k: med(f"timing_s/{k}") for k in STAGES},
        "per_step": {k: each(f"timing_s/{k}") for k in ("step", *STAGES)},
        "mfu": med("perf/mfu/actor"),
        "peak_mem_gb": max((s.get("perf/max_memory_reserved_gb", 0.0) for s in steps), default=0),
        "grad_finite": all(math.isfinite(n) for n in norms)
        and not any(s.get("actor/skipped", 0) for s in steps),
        "grad_norms": norms,
        "response_len": med("response_length/mean"),
    }


# ------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, model_dir: Path, rows: list[dict], seqs: int) -> dict:
    """TRL's GRPOTrainer in a child process (its own CUDA context and memory stats)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "model": str(model_dir),
                    "rows": rows,
                    "seqs": seqs,
                    "out": f"{tmp}/result.json",
                }
            )
        )
        proc = subprocess.run([sys.executable, __file__, "--trl-job", str(job)], check=False)
        result = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result.exists():
            return {"error": f"TRL exited with {proc.returncode} (see its output above)"}
        return json.loads(result.read_text())


def trl_job(path: str) -> None:
    """Body of the child process: one TRL GRPO run, result written as JSON."""
    import dataclasses

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayrl.rewards import compute_score

    job = json.loads(Path(path).read_text())
    a, seqs, rows = argparse.Namespace(**job["args"]), job["seqs"], job["rows"]
    ds = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = []
        for text, truth in zip(texts, ground_truth, strict=True):
            score = compute_score("arithmetic", text, truth, None)
            out.append(float(score["score"] if isinstance(score, dict) else score))
        return out

    micro = min(seqs, a.trl_micro)
    wanted = dict(
        output_dir=str(Path(job["out"]).parent / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=seqs // micro,
        num_generations=a.group,
        max_prompt_length=a.prompt_len,
        max_completion_length=a.response_len,
        generation_kwargs={"min_new_tokens": a.response_len},
        temperature=1.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        beta=0.0,
        bf16=a.device == "cuda",
        use_cpu=a.device == "cpu",
        logging_steps=1,
        max_steps=a.warmup + a.steps,
        report_to=[],
        save_strategy="no",
        use_vllm=False,
        seed=1,
        num_iterations=1,
    )
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in names})

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.starts, self.ends = [], []

        def on_step_begin(self, *args, **kwargs):
            _sync()
            self.starts.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            _sync()
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = GRPOTrainer(
        model=job["model"], reward_funcs=reward, args=config, train_dataset=ds, callbacks=[clock]
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    # With gradient accumulation a step spans several micro-steps: time optimizer steps
    # by the gaps between step ends (the first from its first micro-step's start).
    ends = clock.ends
    times = [ends[0] - clock.starts[0]] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    times = times[a.warmup :]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history]
    step_s = statistics.median(times) if times else None
    result = {
        "step_s": step_s,
        "tokens_per_s": seqs * (a.prompt_len + a.response_len) / step_s if step_s else None,
        "stages": {},
        "peak_mem_gb": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0,
        "grad_finite": bool(norms) and all(math.isfinite(n) for n in norms[a.warmup :]),
        "grad_norms": norms,
        "response_len": next((x for x in reversed(lengths) if x is not None), None),
        "config_dropped": sorted(set(wanted) - names),
    }
    Path(job["out"]).write_text(json.dumps(result))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------ 7B memory
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)


def memory_7b(args: argparse.Namespace, workdir: Path) -> dict:
    """GRPO steps of a 7B-shaped random model through `PPOTrainer` with the memory
    features on; the run's summary plus the model's size and how long writing it took."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    path = write_random_model(workdir / "q7b", {**QWEN25_7B, **(args.shape_7b or {})}, args)
    written = time.perf_counter() - start
    rows = make_rows(AutoTokenizer.from_pretrained(path), 64, args.prompt_len)
    extra = (
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={bool(args.actor_offload_7b)}",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_tokens_7b}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_mem_7b}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.seqs_7b}",
        f"actor_rollout_ref.actor.use_torch_compile={bool(args.compile_7b)}",
        f"actor_rollout_ref.actor.fsdp_config.model_dtype={args.master_dtype_7b}",
        # the GPU machine's 64 GiB disk holds the model (15 GB) and the run's checkpoint
        # (weights + moments, 46 GB at bf16) but not an HF export besides (2026-12-01)
        "trainer.export_hf=false",
        # loading 7B on one core starved the worker's init (half the cores, at most 8)
        f"resources.cpus_per_worker={max(1, min(8, (os.cpu_count() or 2) // 2))}",
    )
    res = run_rayrl(args, path, rows, args.seqs_7b, extra=extra, keep_warmup=True)
    shapes = {**QWEN25_7B, **(args.shape_7b or {})}
    return {**res, "write_model_s": written, "params_b": _param_count(shapes) / 1e9}


def _param_count(shape: dict) -> int:
    """Parameters of a Qwen2 model of ``shape`` (untied head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    heads = 1 if shape.get("tie_word_embeddings") else 2
    return n * layer + heads * shape["vocab_size"] * h + h


def write_random_model(path: Path, shape: dict, args: argparse.Namespace) -> Path:
    """A Qwen2 directory of ``shape`` with N(0, 0.02) bf16 weights drawn on the device
    and written straight to safetensors (no fp32 model, no initialisation pass)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rayrl.models.tiny import preset

    rope = {"rope_type": "default", "rope_theta": 1e6}
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, rope_parameters=rope)
    cfg.architectures = ["Qwen2ForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator(device=args.device).manual_seed(0)
    state = {}
    for name, size in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(size, dtype=torch.bfloat16)
        elif name.endswith("bias"):
            t = torch.zeros(size, dtype=torch.bfloat16)
        else:
            t = torch.randn(size, generator=gen, device=args.device, dtype=torch.bfloat16)
            t = t.mul_(0.02).cpu()
        state[name] = t
    path.mkdir(parents=True)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    del state
    cfg.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(preset("tiny").build(path.parent / "tok"))
    tokenizer.save_pretrained(path)
    return path


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def emit(line: dict, out: Path) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    with out.open("a") as f:
        f.write(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="rayrl,trl")
    p.add_argument("--seqs", default="64,512", help="sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--rollout", default=None, help="rayrl rollout engine (default: native on cuda)")
    p.add_argument("--model-dir", default=None, help="reuse (or keep) the built model here")
    p.add_argument("--worker-logs", action="store_true", help="show rayrl workers' logs")
    p.add_argument("--actor-offload-7b", type=int, default=0, help="7B: actor param_offload")
    p.add_argument("--max-tokens", type=int, default=65536, help="rayrl tokens per micro-batch")
    p.add_argument("--logprob-micro", type=int, default=64, help="rayrl log-prob micro-batch")
    p.add_argument("--trl-micro", type=int, default=64, help="TRL completions per micro-step")
    p.add_argument("--memory-7b", action="store_true")
    p.add_argument("--seqs-7b", type=int, default=16)
    p.add_argument("--max-tokens-7b", type=int, default=8192, help="7B: tokens per micro-batch")
    p.add_argument("--gpu-mem-7b", type=float, default=0.2, help="7B: rollout's GPU share")
    p.add_argument("--compile-7b", type=int, default=0, help="7B: use_torch_compile (memory run)")
    # fp32 master weights need 30 GB of weights + 61 GB of Adam moments: on the 125 GiB
    # host, the offloaded moments, the offloaded reference and the processes did not fit
    p.add_argument("--master-dtype-7b", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--shape-7b", type=json.loads, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a rayrl config override for every rayrl run, after the bench's own (repeatable)",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--measure-card",
        action="store_true",
        help="measure the card's bandwidth and bf16 matmul rate at start for the roofline "
        "(default: the table by device name; an unknown card is always measured)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--trl-job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_job:
        return trl_job(args.trl_job)
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or Path(__file__).parent / "results" / f"{BENCH}-{date:%Y-%m-%d}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    card = resolve_card(gpu, args.measure_card) if args.device == "cuda" else None
    common = {
        "bench": BENCH,
        "device": gpu,
        **(card.fields() if card else {"gpu": None}),
        "date": date.isoformat(timespec="seconds"),
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "group": args.group,
        "preset": args.preset,
        "sft_steps": args.sft_steps,
        "model_name": "0.5b" if args.preset == "qwen2.5-0.5b" else args.preset,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        systems = [s for s in args.systems.split(",") if s]
        if systems:
            model_dir = build_model(args, work)
            from transformers import AutoTokenizer

            rows = make_rows(AutoTokenizer.from_pretrained(model_dir), 1024, args.prompt_len)
        for seqs in (int(s) for s in args.seqs.split(",") if s):
            results = {}
            for system in systems:
                run = run_rayrl if system == "rayrl" else run_trl
                results[system] = run(args, model_dir, rows, seqs)
                if system == "rayrl" and "error" not in results[system]:
                    results[system].update(
                        roofline_of(model_dir, seqs, args, results[system], card)
                    )
                for line in lines_for(system, seqs, results[system], common):
                    emit(line, out)
            mine, theirs = results.get("rayrl", {}), results.get("trl", {})
            if mine.get("tokens_per_s") and theirs.get("tokens_per_s"):
                emit(
                    {
                        **common,
                        "metric": "speedup_vs_trl",
                        "seqs_per_step": seqs,
                        "value": mine["tokens_per_s"] / theirs["tokens_per_s"],
                        "unit": "x",
                        "target": 10,
                        "better": "higher",
                    },
                    out,
                )
        if args.memory_7b:
            res = memory_7b(args, work)
            total = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu != "cpu" else 0
            base = {**common, "model_name": "7b", "system": "rayrl", "seqs_per_step": args.seqs_7b}
            emit(
                {
                    **base,
                    "metric": "peak_mem_gb",
                    "model": "7b",
                    "value": res["peak_mem_gb"],
                    "unit": "GiB",
                    "target": round(total, 1),
                    "better": "lower",
                    **{k: v for k, v in res.items() if k not in ("peak_mem_gb", "response_len")},
                    "mean_response_len": res.get("response_len"),
                },
                out,
            )
            emit(
                {
                    **base,
                    "metric": "step_s",
                    "model": "7b",
                    "value": res["step_s"],
                    "unit": "s",
                    "better": "lower",
                },
                out,
            )


if __name__ == "__main__":
    main()

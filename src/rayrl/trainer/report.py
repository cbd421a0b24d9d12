"""`rayrl report RUN_DIR`: plots of a run's metrics and an HTML page with its config.

Reads `metrics.jsonl` and `config.yaml` and writes, under `RUN_DIR/report/`, one PNG
per panel (score, validation score, KL, entropy, response length, SFT loss, gradient
norm, time per stage stacked, throughput; for multi-turn runs the turns per episode and
the tool calls per tool and step; for asynchronous runs the staleness of the trained
tokens, the sample queue and the idle fractions of trainer and replicas) and
`report.html` showing them with the config.
Panels whose metrics the run did not log are left out and listed in the page. A run
with `trainer.rollout_data_dir` shows a few of its generations too: the first samples of
its last steps (prompt, response, score; an agent's turns), read from that directory.
"""

from __future__ import annotations

import fnmatch
import html
import json
from pathlib import Path
from typing import Any

import yaml

from rayrl.trainer.generations import read_generations
from rayrl.trainer.run_dir import RunDir, read_metrics

# panel file stem -> (title, y label, metric names or prefixes ending in "/")
PANELS: dict[str, tuple[str, str, list[str]]] = {
    "score": ("Training score", "score", ["critic/score/mean"]),
    "val_score": ("Validation score", "score", ["val-core/"]),
    "kl": (
        "KL to the reference",
        "KL",
        ["actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"],
    ),
    "entropy": ("Entropy", "nats/token", ["actor/entropy", "actor/entropy_loss"]),
    "response_length": ("Response length", "tokens", ["response_length/mean"]),
    "loss": ("SFT loss (response tokens)", "nats/token", ["train/loss", "val/loss"]),
    "grad_norm": (
        "Gradient norm",
        "norm",
        ["actor/grad_norm", "critic/grad_norm", "train/grad_norm"],
    ),
    "throughput": ("Throughput per GPU", "tokens/s", ["perf/throughput"]),
    "turns": (
        "Turns per episode (multi-turn)",
        "turns",
        ["multi_turn/num_turns/mean", "multi_turn/num_turns/max", "val-aux/multi_turn/num_turns/"],
    ),
    "tool_calls": ("Tool calls per step", "calls", ["tool/*/calls", "tool/*/errors"]),
    # asynchronous training (`rollout.mode=async`)
    "async_staleness": (
        "Staleness of the trained tokens",
        "policy versions",
        ["async/staleness/mean", "async/staleness/max"],
    ),
    "async_queue": (
        "Sample queue",
        "prompts",
        ["async/queue_size", "async/dropped", "async/requeued", "async/replicas"],
    ),
    "async_idle": (
        "Idle fractions",
        "fraction of the step",
        ["perf/train_idle_fraction", "perf/rollout_idle_fraction"],
    ),
}
STAGE_PREFIX = "timing_s/"
# Stages that overlap others (tools run during generation): not stacked with them.
OVERLAPPING = ("timing_s/step", "timing_s/tools")
# The generations shown: the first samples of the last steps, each text clipped
GENERATION_STEPS, SAMPLES_PER_STEP, TEXT_CHARS = 3, 2, 1500


def _matches(key: str, name: str) -> bool:
    """A metric name, a prefix ending in "/", or a pattern with "*" (`tool/*/calls`)."""
    if "*" in name:
        return fnmatch.fnmatchcase(key, name)
    return key == name or (name.endswith("/") and key.startswith(name))


def _series(
    rows: list[dict[str, Any]], names: list[str]
) -> dict[str, tuple[list[int], list[float]]]:
    keys = sorted({k for r in rows for k in r if any(_matches(k, n) for n in names)})
    out = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            out[key] = ([p[0] for p in points], [p[1] for p in points])
    return out


def _line_plot(path: Path, title: str, ylabel: str, series: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _timing_plot(path: Path, rows: list[dict[str, Any]]) -> bool:
    """Stacked bars of each step's stage times (the total `timing_s/step` and the tools'
    time within the generation left out)."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if any(k.startswith(STAGE_PREFIX) for k in r)]
    stages = sorted(
        {k for r in rows for k in r if k.startswith(STAGE_PREFIX) and k not in OVERLAPPING}
    )
    if not stages:
        return False
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(rows)
    for stage in stages:
        values = [r.get(stage) or 0.0 for r in rows]
        ax.bar(steps, values, bottom=bottom, label=stage.removeprefix(STAGE_PREFIX))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title="Time per stage", xlabel="step", ylabel="seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and report.html; returns the HTML file."""
    import matplotlib

    matplotlib.use("Agg")
    run = RunDir(Path(run_dir))
    rows = read_metrics(run.metrics)
    run.report.mkdir(parents=True, exist_ok=True)
    written, missing = [], []
    for stem, (title, ylabel, names) in PANELS.items():
        series = _series(rows, names)
        if series:
            _line_plot(run.report / f"{stem}.png", title, ylabel, series)
            written.append((stem, title))
        else:
            missing.append(title)
    if _timing_plot(run.report / "timing.png", rows):
        written.append(("timing", "Time per stage"))
    else:
        missing.append("Time per stage")
    config = run.config.read_text() if run.config.is_file() else "(no config.yaml)"
    page = run.report / "report.html"
    generations = _generations_html(run.root, config)
    page.write_text(_html(run.root, rows, written, missing, config, generations))
    return page


def _html(
    root: Path,
    rows: list[dict[str, Any]],
    written: list[Any],
    missing: list[Any],
    config: str,
    generations: str,
) -> str:
    steps = [r["step"] for r in rows]
    figures = "\n".join(
        f'<figure><img src="{stem}.png" alt="{html.escape(title)}"><figcaption>'
        f"{html.escape(title)}</figcaption></figure>"
        for stem, title in written
    )
    absent = f"<p>Not logged by this run: {html.escape(', '.join(missing))}.</p>" if missing else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rayrl report: {html.escape(root.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} figure{{display:inline-block;margin:.5em}}
img{{width:480px}} pre{{background:#f4f4f4;padding:1em;overflow:auto}}
pre.gen{{white-space:pre-wrap;max-height:20em;margin:.2em 0 1em}}</style></head>
<body><h1>rayrl run {html.escape(str(root))}</h1>
<p>{len(rows)} logged steps{f", steps {min(steps)} to {max(steps)}" if steps else ""}.</p>
{figures}
{absent}
{generations}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""


def _generations_html(root: Path, config: str) -> str:
    """The section of a few generations of `trainer.rollout_data_dir`; "" without one."""
    try:
        loaded = yaml.safe_load(config)
    except yaml.YAMLError:
        return ""
    trainer = (loaded.get("trainer") if isinstance(loaded, dict) else None) or {}
    path = trainer.get("rollout_data_dir") if isinstance(trainer, dict) else None
    if not path:
        return ""
    directory = Path(path).expanduser()
    if not directory.is_absolute():
        directory = _run_cwd(root, trainer.get("output_dir")) / directory
    steps = (
        read_generations(directory, GENERATION_STEPS, SAMPLES_PER_STEP)
        if directory.is_dir()
        else []
    )
    where = html.escape(str(directory))
    if not steps:
        return f"<h2>Generations</h2><p>None written to {where} (trainer.rollout_data_dir).</p>"
    parts = [
        f"<h2>Generations</h2><p>The first {SAMPLES_PER_STEP} samples of the last "
        f"{len(steps)} step(s), from {where} (trainer.rollout_data_dir).</p>"
    ]
    for step, samples in steps:
        parts.append(f"<h3>Step {step}</h3>")
        parts.extend(_sample_html(sample) for sample in samples)
    return "\n".join(parts)


def _run_cwd(root: Path, output_dir: str | None) -> Path:
    """The directory the run was started in, which its relative paths start from: the
    run directory less a relative `trainer.output_dir`, else the working directory."""
    out = Path(output_dir or "")
    root = root.absolute()
    if output_dir and not out.is_absolute() and root.parts[-len(out.parts) :] == out.parts:
        return Path(*root.parts[: -len(out.parts)])
    return Path.cwd()


def _sample_html(sample: dict[str, Any]) -> str:
    """One sample: its score and ids, then its prompt and response (an agent's turns)."""
    about = [f"score {sample.get('score')}", f"uid {sample.get('uid')}"]
    if sample.get("weight_version") is not None:
        about.append(f"policy version {sample['weight_version']}")
    if sample.get("num_turns") is not None:
        about.append(f"{sample['num_turns']} turns")
    texts = [("turns", _turns_text(sample["turns"]))] if sample.get("turns") else []
    if not texts:
        texts = [("prompt", sample.get("input", "")), ("response", sample.get("output", ""))]
    body = "".join(
        f'<b>{name}</b><pre class="gen">{html.escape(_clip(str(text)))}</pre>'
        for name, text in texts
    )
    return f"<p>{html.escape(' · '.join(about))}</p>{body}"


def _turns_text(turns: list[Any]) -> str:
    """A trajectory's messages as text: `[role] content`, each tool call on its own line."""
    lines = []
    for message in turns:
        if not isinstance(message, dict):
            lines.append(str(message))
            continue
        name = f" {message['name']}" if message.get("name") else ""
        lines.append(f"[{message.get('role', '?')}{name}] {message.get('content') or ''}")
        for call in message.get("tool_calls") or []:
            lines.append(f"  tool call: {json.dumps(call, ensure_ascii=False, default=str)}")
    return "\n".join(lines)


def _clip(text: str) -> str:
    """`text`, its middle left out when longer than `TEXT_CHARS`."""
    if len(text) <= TEXT_CHARS:
        return text
    half = TEXT_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters ...]\n{text[-half:]}"

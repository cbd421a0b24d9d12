"""`rayrl report RUN_DIR`: plots of a run's metrics and an HTML page with its config.

Reads `metrics.jsonl` and `config.yaml` and writes, under `RUN_DIR/report/`, one PNG
per panel (score, validation score, KL, entropy, response length, SFT loss, gradient
norm, time per stage stacked, throughput; for multi-turn runs the turns per episode and
the tool calls per tool and step; for asynchronous runs the staleness of the trained
tokens, the sample queue and the idle fractions of trainer and replicas) and
`report.html` showing them with the config.
Panels whose metrics the run did not log are left out and listed in the page.
"""

from __future__ import annotations

import fnmatch
import html
from pathlib import Path

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


def _matches(key: str, name: str) -> bool:
    """A metric name, a prefix ending in "/", or a pattern with "*" (`tool/*/calls`)."""
    if "*" in name:
        return fnmatch.fnmatchcase(key, name)
    return key == name or (name.endswith("/") and key.startswith(name))


def _series(rows: list[dict], names: list[str]) -> dict[str, tuple[list[int], list[float]]]:
    keys = sorted({k for r in rows for k in r if any(_matches(k, n) for n in names)})
    out = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            out[key] = ([p[0] for p in points], [p[1] for p in points])
    return out


def _line_plot(path: Path, title: str, ylabel: str, series: dict) -> None:
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


def _timing_plot(path: Path, rows: list[dict]) -> bool:
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
    page.write_text(_html(run.root, rows, written, missing, config))
    return page


def _html(root: Path, rows: list[dict], written: list, missing: list, config: str) -> str:
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
img{{width:480px}} pre{{background:#f4f4f4;padding:1em;overflow:auto}}</style></head>
<body><h1>rayrl run {html.escape(str(root))}</h1>
<p>{len(rows)} logged steps{f", steps {min(steps)} to {max(steps)}" if steps else ""}.</p>
{figures}
{absent}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""

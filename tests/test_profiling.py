"""Profiles a user can take (`global_profiler.*`, `rayrl.trainer.profiling`): a tiny
`rayrl train` traces the chosen step of the chosen roles only, into the run directory,
with the step's stage timeline; the traces parse and hold torch ops."""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import start_local_ray
from rayrl.cli.main import main
from rayrl.config import ConfigError, load_config
from rayrl.controller.tracing import join_traces

TINY = [
    "trainer.device=cpu",
    "trainer.total_training_steps=2",
    "data.train_batch_size=2",
    "data.synthetic_size=4",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
    "trainer.logger=[console]",
]


def _events(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_train_traces_the_chosen_step_and_roles_with_the_timeline(tmp_path):
    start_local_ray()
    out = tmp_path / "run"
    profile = [
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        # verl's per-role keys: the actor and the rollout only, the rollout per call
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.rollout.profiler.enable=true",
        "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=true",
    ]
    assert main(["train", "-c", "demo", *TINY, *profile, f"trainer.output_dir={out}"]) == 0
    profiles = out / "profiles"
    assert sorted(p.name for p in profiles.iterdir()) == ["step_2"]  # not step 1
    step = profiles / "step_2"
    names = sorted(p.name for p in step.iterdir())
    assert names == ["actor_rank0.json.gz", "rollout_rank0.generate.json.gz", "timeline.json"]
    actor = _events(step / "actor_rank0.json.gz")
    ops = {e["name"] for e in actor if e.get("cat") == "cpu_op"}
    assert "aten::mm" in ops or "aten::addmm" in ops or "aten::linear" in ops, sorted(ops)[:20]
    assert any(e.get("cat") == "cpu_op" for e in _events(step / "rollout_rank0.generate.json.gz"))
    timeline = json.loads((step / "timeline.json").read_text())
    stages = {e["name"] for e in timeline["traceEvents"] if e.get("ph") == "X"}
    assert {"step", "gen", "update_actor"} <= stages
    other = timeline["otherData"]
    assert other["step"] == 2 and other["timing_s"]["timing_s/step"] > 0
    assert sorted(other["traces"]) == names[:2]


def test_join_puts_the_calls_on_one_clock(tmp_path):
    parts = []
    for i, base in enumerate((1_000_000_000, 3_000_000_000)):  # the second 2 s later
        path = tmp_path / f"p{i}.json.gz"
        trace = {
            "baseTimeNanoseconds": base,
            "traceEvents": [{"ph": "X", "ts": 5.0, "name": f"c{i}"}],
        }
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)
        parts.append(path)
    join_traces(parts, tmp_path / "joined.json.gz")
    events = _events(tmp_path / "joined.json.gz")
    assert [(e["name"], e["ts"]) for e in events] == [("c0", 5.0), ("c1", 2_000_005.0)]
    assert not any(p.exists() for p in parts)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("global_profiler.steps=[two]", "must be a list"),
        ("critic.profiler.tool_config.torch.contents=[gpu]", "choose from"),
    ],
)
def test_what_cannot_be_profiled_is_refused_with_what_to_do(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config("demo", ["global_profiler.tool=torch", "global_profiler.steps=[1]", override])


@pytest.mark.parametrize(
    ("tool", "says"), [("nsys", "Nsight Systems"), ("npu", "does not run Ascend")]
)
def test_another_tool_traces_nothing_and_says_what_to_use(tool, says, tmp_path):
    """A script written for Nsight or an NPU still loads (and trains): no traces, a
    warning naming tool=torch."""
    warned: list[str] = []
    cfg = load_config(
        "demo", [f"global_profiler.tool={tool}", "global_profiler.steps=[1]"], warn=warned.append
    )
    assert any(says in w and "global_profiler.tool=torch" in w for w in warned), warned
    from rayrl.trainer.profiling import StepProfiler

    assert StepProfiler(cfg.global_profiler, tmp_path, print).steps == set()


def test_a_tool_without_steps_profiles_nothing_and_says_so():
    warned: list[str] = []  # verl's example scripts set tool=torch_memory so
    load_config("demo", ["global_profiler.tool=torch_memory"], warn=warned.append)
    assert any("global_profiler.steps is not set" in w for w in warned)


def test_verls_profiler_keys_land_under_global_profiler():
    warned: list[str] = []
    cfg = load_config(
        "demo",
        [
            "actor_rollout_ref.ref.profiler.all_ranks=true",
            "critic.profiler.ranks=[1,2]",
            "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.wait=2",
        ],
        warn=warned.append,
    )
    prof = cfg.global_profiler
    assert prof.traced_ranks("ref") is None and prof.traced_ranks("critic") == (1, 2)
    assert prof.traced_ranks("actor") == (0,) and prof.traced_roles() == (
        "rollout",
        "actor",
        "ref",
        "critic",
    )
    assert any("schedule.wait=2 has no effect" in w for w in warned)


def test_only_the_chosen_roles_and_ranks_are_traced(tmp_path):
    from types import SimpleNamespace

    from rayrl.controller import tracing
    from rayrl.trainer.profiling import StepProfiler

    cfg = load_config(
        "demo",
        [
            "global_profiler.tool=torch",
            "global_profiler.steps=[1]",
            "actor_rollout_ref.actor.profiler.enable=true",
            "actor_rollout_ref.actor.profiler.ranks=[1]",
        ],
    ).global_profiler
    targets = StepProfiler(cfg, tmp_path, print).targets
    assert sorted(targets) == ["compute_log_prob", "update_actor"]  # no generate, no ref
    tracing.arm(tracing.TraceWindow(str(tmp_path), targets))
    try:
        assert tracing._hook(SimpleNamespace(rank=0), "update_actor") is None  # rank 0
        assert tracing._hook(SimpleNamespace(rank=1), "generate") is None  # the rollout
        with tracing._hook(SimpleNamespace(rank=1), "update_actor"):
            import torch

            torch.ones(4, 4) @ torch.ones(4, 4)
    finally:
        written = tracing.disarm()
    assert written == [str(tmp_path / "actor_rank1.json.gz")]
    assert any(e.get("name") == "aten::mm" for e in _events(written[0]))

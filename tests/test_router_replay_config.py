"""Routing replay's keys (verl's names) at load, without Ray: what cannot work is refused
with the setting that makes it work, what has no effect is said; and the columns and
passes the keys give the actor's calls."""

from __future__ import annotations

import json

import pytest

from rayrl.algos.routing import ACTOR_ROUTES, ROUTES
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.config.errors import ConfigError, ConfigWarning
from rayrl.config.routing_checks import MOE_MODEL_TYPES
from rayrl.train.router_replay import ROUTER_STYLES, RoutingPass
from rayrl.trainer.on_policy import separate_pass_reason
from rayrl.workers.actor import update_actor_reads
from rayrl.workers.log_prob_pass import LOG_PROB_READS
from rayrl.workers.routing import check_recording_engine, log_prob_pass, update_pass

MODE = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
NATIVE = "actor_rollout_ref.rollout.name=native"


@pytest.fixture
def moe_path(tmp_path):
    """A model directory whose config says Qwen3-MoE (all the load-time checks read)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return f"actor_rollout_ref.model.path={tmp_path}"


def load(*overrides: str):
    return load_config("grpo", ["trainer.device=cpu", *overrides])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"{MODE}=R3", NATIVE],
            f"R3 replays the rollout.s record.*only with {RECORD}=true: set it",
        ),
        ([f"{MODE}=R4"], r"router_replay.mode='R4' is not one of disabled, R2, R3"),
        (
            [f"{MODE}=R2", "algorithm.rollout_correction.bypass_mode=true"],
            "R2 records the routing in the actor's log-prob pass, which .*bypass_mode=true skips",
        ),
        ([f"{RECORD}=true", "actor_rollout_ref.rollout.name=hf"], "hf engine does not"),
        ([f"{RECORD}=true"], r"rollout.name=auto picks it on a CPU.*name=native"),
        (
            [f"{RECORD}=true", NATIVE, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
            "Ulysses sequence parallelism",
        ),
    ],
    ids=["R3-unrecorded", "bad-mode", "R2-bypass", "hf", "auto-on-cpu", "ulysses"],
)
def test_what_cannot_work_is_refused_with_what_to_set(moe_path, overrides, message):
    gpus = ["trainer.n_gpus_per_node=2"] if "ulysses" in message.lower() else []
    with pytest.raises(ConfigError, match=message):
        load(moe_path, *gpus, *overrides)


def test_r3_with_the_native_record_loads_and_verl_spellings_land(moe_path, recwarn):
    cfg = load(moe_path, f"{RECORD}=true", NATIVE, f"{MODE}=R3")
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
    assert not [w for w in recwarn.list if issubclass(w.category, ConfigWarning)]
    megatron = "actor_rollout_ref.actor.megatron.router_replay.mode=R2"  # verl's Megatron key
    assert load(moe_path, megatron).actor_rollout_ref.actor.router_replay.mode == "R2"


def test_what_has_no_effect_is_said():
    with pytest.warns(ConfigWarning, match="Qwen2|qwen2, not a mixture of experts"):
        load(f"{RECORD}=true", NATIVE, f"{MODE}=R3")  # the built-in demo model: dense


def test_compile_off_is_said_where_it_would_compile(moe_path):
    with pytest.warns(ConfigWarning, match="use_torch_compile=true has no effect"):
        load_config("grpo", ["trainer.device=cuda", moe_path, f"{MODE}=R2"])


def test_the_model_families_agree_with_the_training_side():
    assert sorted(ROUTER_STYLES) == sorted(MOE_MODEL_TYPES)


def test_the_modes_give_the_passes_their_columns(moe_path):
    r3 = load(moe_path, f"{RECORD}=true", NATIVE, f"{MODE}=R3")
    r2 = load(moe_path, f"{MODE}=R2")
    off = load(moe_path)
    assert ROUTES in LOG_PROB_READS  # compared whenever the samples carry it
    assert ROUTES in update_actor_reads(r3) and ACTOR_ROUTES not in update_actor_reads(r3)
    assert ACTOR_ROUTES in update_actor_reads(r2) and ROUTES not in update_actor_reads(r2)
    assert not {ROUTES, ACTOR_ROUTES} & set(update_actor_reads(off))
    watched = load(moe_path, f"{RECORD}=true", NATIVE)  # no replay: an on-policy update counts
    assert ROUTES in update_actor_reads(watched)
    assert "R2 records" in separate_pass_reason(r2, 8)  # one mini-batch: R2 keeps the pass
    assert separate_pass_reason(off, 8) is None
    recorded = Batch({ROUTES: _routes()})
    assert log_prob_pass(r3, recorded) == RoutingPass(replay=True, compare=True)
    assert log_prob_pass(r2, Batch({"x": _routes()})) == RoutingPass(record=True)
    assert log_prob_pass(off, recorded) == RoutingPass(compare=True)
    assert log_prob_pass(off, Batch({"x": _routes()})) is None


def test_a_replay_mode_without_its_record_is_an_error_not_a_fallback(moe_path):
    from family_cases import family_model

    r3 = load(moe_path, f"{RECORD}=true", NATIVE, f"{MODE}=R3")
    r2 = load(moe_path, f"{MODE}=R2")
    with pytest.raises(ValueError, match="the rollout recorded no routing"):
        update_pass(r3, Batch({"x": _routes()}), family_model("qwen3_moe"))
    with pytest.raises(ValueError, match="the log-prob pass did not run"):
        update_pass(r2, Batch({"x": _routes()}), family_model("qwen3_moe"))
    batch, plan = update_pass(r2, Batch({ACTOR_ROUTES: _routes()}), family_model("qwen3_moe"))
    assert plan == RoutingPass(replay=True) and batch[ROUTES] is batch[ACTOR_ROUTES]
    assert update_pass(r3, Batch({"x": _routes()}), family_model("qwen2"))[1] is None  # dense
    recorded = Batch({ROUTES: _routes()})  # on-policy: the update counts, as the pass would
    on_policy = update_pass(r3, recorded, family_model("qwen3_moe"), on_policy=True)[1]
    assert on_policy == RoutingPass(replay=True, compare=True)
    off = load(moe_path, f"{RECORD}=true", NATIVE)
    assert update_pass(off, recorded, family_model("qwen3_moe"), on_policy=True)[1] == RoutingPass(
        compare=True
    )
    assert update_pass(off, recorded, family_model("qwen3_moe"))[1] is None
    with pytest.raises(ValueError, match="this worker's is 'hf'.*name=native"):
        check_recording_engine(r3, "hf")
    check_recording_engine(r3, "native")


def _routes():
    import torch

    return torch.zeros(2, 5, 1, 2, dtype=torch.uint8)

"""The reference policy under expert parallelism (``actor_rollout_ref.ref.expert_parallel_size``,
the actor's unless set) on real gloo processes: built as the workers build it, it splits
a mixture of experts' experts over its ranks, and its log-probs equal one process's,
whatever the actor's and the reference's sizes; the key is checked at load."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from parallel_cases import batch
from rayrl.config import ConfigError


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ref") / "m", family="qwen3_moe", seed=4)


@pytest.mark.slow  # three actor + reference builds on 2 gloo ranks: ~50-70 s on two cores
def test_reference_splits_experts_and_matches_one_process(tmp_path, moe_dir):
    from rayrl.train.engine import TrainEngine
    from ref_ep_cases import CASES, ref_worker

    mp.spawn(ref_worker, args=(2, str(tmp_path / "init"), str(moe_dir), str(tmp_path)), nprocs=2)
    one = TrainEngine(moe_dir, trainable=False).forward(batch(), micro_batch_size=3)["log_probs"]
    for rank in range(2):
        results = torch.load(tmp_path / f"ref{rank}.pt", weights_only=False)
        for name, (actor_ep, ref_ep) in CASES.items():
            r = results[name]
            want_ep = actor_ep if ref_ep is None else ref_ep
            assert r["ref_ep_key"] == want_ep, name  # unset: the actor's size
            mesh = {1: ("dp_shard",), 2: ("edp", "ep")}
            assert r["ref_experts"] == (want_ep, mesh[want_ep]), name
            assert r["actor_experts"] == (actor_ep, mesh[actor_ep]), name
            torch.testing.assert_close(r["log_probs"], one[r["rows"]], atol=1e-5, rtol=0)


def test_the_reference_key_is_checked_at_load_naming_it(moe_dir):
    from ref_ep_cases import config

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.expert_parallel_size=3"):
        config(moe_dir, 2, 3)
    with pytest.raises(ConfigError, match=r"ref\.expert_parallel_size=8.*divide the 2"):
        config(moe_dir, 1, 8)
    assert config(moe_dir, 2, None).actor_rollout_ref.ref.expert_parallel_size == 2
    assert config(moe_dir, 1, None).actor_rollout_ref.ref.expert_parallel_size == 1

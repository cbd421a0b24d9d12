"""Critic and Reward roles on real Ray, and actor + critic colocated in one process."""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from rayrl.batch import Batch
from rayrl.controller import colocate
from rayrl.models import build_tiny_model
from rayrl.workers import ActorRolloutRefWorker, CriticWorker, ReferenceWorker, RewardWorker
from workers_cases import (
    close,
    config,
    forced_batch,
    generate,
    group_on,
    prompts,
    update_critic,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("roles") / "m", layers=1, hidden=32))


def test_critic_computes_values_and_learns_returns(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config("algorithm.adv_estimator=gae", "critic.optim.lr=0.01", "critic.ppo_epochs=4")
    group, pool, kv = group_on(CriticWorker, 1, "critic")
    try:
        group.init(timeout_s=300, config=cfg, model_path=model_dir)
        batch = forced_batch(prompts(tok, 2).repeat(2), 42, 6)
        values = group.compute_values(batch)["values"]
        assert values.shape == (4, 6)
        batch["values"], batch["returns"] = values, torch.ones(4, 6)
        first = update_critic(group, batch)["critic/vf_loss"]
        for _ in range(3):
            batch["values"] = group.compute_values(batch)["values"]
            last = update_critic(group, batch)["critic/vf_loss"]
        assert last < first / 2
    finally:
        close(group, pool, kv)


REWARD_FILE = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "boom" in solution_str:
        raise RuntimeError("reward function exploded")
    if "sleep" in solution_str:
        time.sleep(60)
    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0
"""


def _responses(tok, texts: list[str], ground_truth: list[str]) -> Batch:
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    responses = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        responses[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
    return Batch.from_dict(
        {
            "responses": responses,
            "response_mask": mask,
            "data_source": ["arithmetic"] * len(ids),
            "ground_truth": ground_truth,
        }
    )


def test_reward_worker_scores_last_token_and_survives_bad_functions(ray_local, model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    group, pool, kv = group_on(RewardWorker, 1, "reward")
    try:
        group.init(timeout_s=300, config=config(), tokenizer_path=model_dir)
        batch = _responses(tok, ["It is 19", "It is 7", "no idea"], ["19", "19", "19"])
        out = group.compute_score(batch)
        assert out["scores"].tolist() == pytest.approx([1.0, 0.1, 0.0])
        lengths = batch["response_mask"].sum(-1)
        for row in range(3):
            expected = torch.zeros(batch["responses"].shape[1])
            expected[lengths[row] - 1] = out["scores"][row]
            assert torch.equal(out["token_level_scores"][row], expected)
    finally:
        close(group, pool, kv)

    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    cfg = config(f"custom_reward_function.path={path}", "reward.timeout_s=2")
    group, pool, kv = group_on(RewardWorker, 1, "reward")
    try:
        group.init(timeout_s=300, config=cfg, tokenizer_path=model_dir)
        texts = ["answer 5", "boom", "sleep", "answer 4"]
        out = group.compute_score(_responses(tok, texts, ["5", "5", "5", "5"]))
        assert out["scores"].tolist() == [1.0, 0.0, 0.0, 0.0]
        errors = list(out["reward_error"])
        assert errors[0] is None and errors[3] is None
        assert "reward function exploded" in errors[1]
        assert "timed out" in errors[2]
        stats = group.stats()[0]
        assert stats["timeouts"] == 1 and stats["errors"] == 2
    finally:
        close(group, pool, kv)


def test_actor_and_critic_colocated_in_one_process(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config("algorithm.adv_estimator=gae")
    fused = colocate({"actor": ActorRolloutRefWorker, "critic": CriticWorker})
    group, pool, kv = group_on(fused, 1, "hybrid", cpus=1)
    try:
        group.init(
            timeout_s=300,
            actor={"config": cfg, "model_path": model_dir, "with_ref": False},
            critic={"config": cfg, "model_path": model_dir},
        )
        actor, critic = group.view("actor"), group.view("critic")
        out = generate(actor, prompts(tok, 2))
        values = critic.compute_values(out)["values"]
        assert values.shape == out["responses"].shape
        assert actor.device_info()[0]["pid"] == group.describe(0).pid
    finally:
        close(group, pool, kv)


@pytest.mark.slow
def test_standalone_reference_matches_the_colocated_one(ray_local, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = config()
    actor, apool, akv = group_on(ActorRolloutRefWorker, 1, "actor")
    ref, rpool, rkv = group_on(ReferenceWorker, 2, "ref")
    try:
        actor.init(timeout_s=300, config=cfg, model_path=model_dir)
        ref.init(timeout_s=300, backend="gloo", config=cfg, model_path=model_dir)
        out = generate(actor, prompts(tok, 3))  # 6 samples over 2 reference ranks
        mask = out["response_mask"].bool()
        colocated = actor.compute_ref_log_prob(out)["ref_log_prob"]
        standalone = ref.compute_ref_log_prob(out)["ref_log_prob"]
        torch.testing.assert_close(standalone[mask], colocated[mask], atol=1e-5, rtol=1e-5)
    finally:
        close(actor, apool, akv)
        close(ref, rpool, rkv)


def test_reward_worker_scores_through_a_real_http_service(ray_local, model_dir):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls: list[int] = []

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            calls.append(len(items))
            if len(calls) == 1:  # the first request fails: the worker's client retries
                status, body = 503, b"{}"
            else:
                scores = [float(i["solution_str"].strip() == i["ground_truth"]) for i in items]
                status, body = 200, json.dumps({"scores": scores}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tok = AutoTokenizer.from_pretrained(model_dir)
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    group, pool, kv = group_on(RewardWorker, 1, "reward")
    try:
        group.init(timeout_s=300, config=config(f"reward.http.url={url}"), tokenizer_path=model_dir)
        out = group.compute_score(_responses(tok, ["19", "7"], ["19", "19"]))
        assert out["scores"].tolist() == [1.0, 0.0]
        assert calls == [2, 2]
    finally:
        close(group, pool, kv)
        server.shutdown()

"""`actor_rollout_ref.rollout.temperature=0` means greedy decoding, as verl users expect:
each token is the argmax of the logits, and the actor's and reference's log-probs are
the temperature-1 ones the rollout records (`workers.common.logprob_temperature`), not
a division by zero."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rayrl.models import build_tiny_model
from rayrl.workers import ActorRolloutRefWorker
from rayrl.workers.common import logprob_temperature
from workers_cases import config, generate, local_worker, prompts, update_actor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("greedy") / "m", layers=1, hidden=32))


def test_temperature_zero_decodes_greedily_and_trains_on_finite_log_probs(model_dir):
    cfg = config(
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    worker = local_worker(ActorRolloutRefWorker, config=cfg, model_path=model_dir)
    out = generate(worker, prompts(AutoTokenizer.from_pretrained(model_dir), 2))
    responses, mask = out["responses"], out["response_mask"].bool()
    assert torch.equal(responses[0], responses[1]) and torch.equal(responses[2], responses[3])

    # every sampled token is the argmax of the model's logits at its position
    width = responses.shape[1]
    with torch.no_grad():
        logits = worker.actor.model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits[:, -width - 1 : -1]
    assert torch.equal(logits.argmax(-1)[mask], responses[mask])

    old = worker.compute_log_prob(out)["old_log_probs"]
    ref = worker.compute_ref_log_prob(out)["ref_log_prob"]
    want = torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1))[..., 0]
    for got in (old, ref, out["rollout_log_probs"]):
        assert torch.isfinite(got[mask]).all()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)

    batch = out.union(worker.compute_ref_log_prob(out))
    batch["old_log_probs"] = old
    batch["advantages"] = torch.ones(responses.shape)
    metrics = update_actor(worker, batch)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    assert metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    ("temperature", "do_sample", "want"), [(0.0, True, 1.0), (0.7, False, 1.0), (0.7, True, 0.7)]
)
def test_log_probs_are_of_the_distribution_the_rollout_draws_from(temperature, do_sample, want):
    cfg = config(
        f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.do_sample={do_sample}",
    )
    assert logprob_temperature(cfg.actor_rollout_ref.rollout) == want

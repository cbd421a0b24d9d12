"""ModelReward with a tiny random Qwen2ForSequenceClassification saved next to a real tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from rayrl.models import TinySpec, train_tokenizer
from rayrl.rewards import RewardResult
from rayrl.rewards.model import ModelReward

PROMPTS = [
    [{"role": "user", "content": "What is 12+7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3*4?"}],
    [{"role": "user", "content": "What is 9-5?"}],
]
RESPONSES = ["19", "The answer is 12, because three fours make twelve.", "5"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    """A 1-layer reward model with random weights and a non-trivial score head."""
    out = tmp_path_factory.mktemp("rm")
    tokenizer = train_tokenizer()
    config = TinySpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64).to_config(
        tokenizer
    )
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm(rm_dir) -> ModelReward:
    return ModelReward(rm_dir, micro_batch_size=2)


def test_one_float_per_sequence_deterministic_across_loads(rm, rm_dir):
    scores = rm.score_chats(PROMPTS, RESPONSES)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == 3  # different conversations, different scores
    assert rm.score_chats(PROMPTS, RESPONSES) == scores
    again = ModelReward(rm_dir, micro_batch_size=3, dtype="float32")
    assert again.score_chats(PROMPTS, RESPONSES) == pytest.approx(scores, abs=1e-5)


def test_the_score_is_the_heads_output_at_the_last_real_token(rm):
    text = rm.render(PROMPTS[0], RESPONSES[0])
    assert text.endswith("<|im_start|>assistant\n19<|im_end|>\n")
    ids = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    alone = rm.score_texts([text])[0]
    model = rm.model
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0, 0].item()  # HF pools the last position
        truncated = rm.score_texts([rm.tokenizer.decode(ids[:-3])])[0]
    assert alone == pytest.approx(hf, abs=1e-5)
    assert truncated != pytest.approx(alone, abs=1e-6)


def test_left_and_right_padding_give_the_same_scores(rm):
    texts = [rm.render(p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    seqs = [rm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, seqs)) + 2
    pad = rm.tokenizer.pad_token_id
    right = torch.full((3, width), pad)
    left = torch.full((3, width), pad)
    right_mask = torch.zeros(3, width, dtype=torch.long)
    left_mask = torch.zeros(3, width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        right[row, : len(seq)], right_mask[row, : len(seq)] = torch.tensor(seq), 1
        left[row, width - len(seq) :], left_mask[row, width - len(seq) :] = torch.tensor(seq), 1
    from_right = rm.score_ids(right, right_mask)
    from_left = rm.score_ids(left, left_mask)
    assert from_right.shape == (3,) and from_right.dtype == torch.float32
    torch.testing.assert_close(from_left, from_right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_right, torch.tensor(rm.score_texts(texts)), atol=1e-5, rtol=0)


def test_micro_batch_size_does_not_change_scores(rm, rm_dir):
    one = ModelReward(rm_dir, micro_batch_size=1)
    assert one.score_chats(PROMPTS, RESPONSES) == pytest.approx(
        rm.score_chats(PROMPTS, RESPONSES), abs=1e-5
    )


def test_score_items_and_input_errors(rm):
    items = [{"prompt": p, "solution_str": r} for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    items.append({"prompt": "What is 1+1?", "solution_str": "2"})  # a plain-text prompt
    results = rm.score(items)
    assert all(isinstance(r, RewardResult) and r.ok for r in results) and len(results) == 4
    assert [r.score for r in results[:3]] == pytest.approx(rm.score_chats(PROMPTS, RESPONSES))
    with pytest.raises(ValueError, match="no attended token"):
        rm.score_ids(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="one shape"):
        rm.score_ids(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        rm.score_chats(PROMPTS[:2], RESPONSES[:1])


def test_max_length_keeps_the_end_of_long_sequences(rm_dir, rm):
    short = ModelReward(rm_dir, max_length=4)
    text = rm.render(PROMPTS[1], RESPONSES[1])
    ids = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    tail = rm.tokenizer.decode(ids[-4:])
    assert short.score_texts([text]) == pytest.approx(rm.score_texts([tail]), abs=1e-5)


def test_bounded_scores_clip_or_squash_and_keep_the_raw_score(rm):
    from rayrl.rewards.budget import BoundedScores

    items = [{"prompt": p, "solution_str": r} for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    raw = [r.score for r in rm.score(items)]
    assert max(abs(s) for s in raw) > 0.05  # the random head gives scores to bound
    scale = min(abs(s) for s in raw) / 2
    for transform, expected in (
        ("clip", [max(-scale, min(scale, s)) for s in raw]),
        ("tanh", [scale * math.tanh(s / scale) for s in raw]),
    ):
        out = BoundedScores(rm, transform, scale).score(items)
        assert [r.score for r in out] == pytest.approx(expected)
        assert [r.extra["raw_score"] for r in out] == pytest.approx(raw)
        assert all(abs(r.score) <= scale for r in out)


def test_reward_worker_runs_the_model_where_its_bundle_is_with_bounded_scores(rm_dir):
    import numpy as np

    from rayrl.config import load_config
    from rayrl.rewards.budget import BoundedScores
    from rayrl.workers import RewardWorker
    from rayrl.workers.model_placement import reward_model_placement
    from workers_cases import local_worker

    cfg = load_config(
        "grpo",
        [
            "reward_model.enable=true",
            f"reward_model.model.path={rm_dir}",
            "reward_model.micro_batch_size_per_gpu=2",
            "reward_model.score_transform=tanh",
            "reward_model.score_scale=0.01",
        ],
    )
    worker = local_worker(RewardWorker, config=cfg, tokenizer_path=str(rm_dir))
    assert isinstance(worker.source.source, BoundedScores)  # under the error budget
    model = worker.source.source.source
    expected = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    assert (model.device.type, model.dtype) == expected
    assert reward_model_placement()[1] == expected[1]
    ids = worker.tokenizer(RESPONSES[0])["input_ids"]
    batch = _reward_batch(ids)
    out = worker.compute_score(batch)
    assert abs(float(out["scores"][0])) < 0.01
    assert "raw_score" in out["reward_extra"][0] and isinstance(out["reward_extra"], np.ndarray)


def _reward_batch(ids: list[int]):
    import numpy as np

    from rayrl.batch import Batch

    def obj(value):
        out = np.empty(1, dtype=object)
        out[0] = value
        return out

    return Batch(
        {
            "responses": torch.tensor([ids]),
            "response_mask": torch.ones(1, len(ids), dtype=torch.long),
        },
        {
            "data_source": obj("arithmetic"),
            "ground_truth": obj("19"),
            "extra_info": obj({}),
            "raw_prompt": obj(PROMPTS[0]),
        },
    )


def test_non_finite_scores_fail_and_count_against_the_error_rate(rm_dir):
    from rayrl.rewards.budget import BoundedScores, ErrorBudget, RewardErrorRateError

    broken = ModelReward(rm_dir, micro_batch_size=2)
    with torch.no_grad():
        broken.model.score.weight.fill_(float("nan"))
    items = [{"prompt": p, "solution_str": r} for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    results = broken.score(items)
    assert all(r.score == 0.0 and "non-finite score (nan)" in r.error for r in results)
    budget = ErrorBudget(BoundedScores(broken, "tanh", 1.0), 0.5, reward=f"reward model {rm_dir}")
    with pytest.raises(RewardErrorRateError, match=r"reward model .* failed on 3 of 3 samples"):
        budget.score(items)


def test_a_reward_model_shards_over_its_workers_like_any_role(ray_local, rm_dir):
    """`reward.workers_per_node=2` with a reward model: the reward pool from the config
    holds two workers (one GPU each on a GPU run; CPU here), each a data-parallel rank
    of the model; split over them, a batch scores exactly as on one rank."""
    import uuid

    from rayrl.cluster.pool import reserve_pools
    from rayrl.config import load_config
    from rayrl.controller import WorkerGroup
    from rayrl.trainer.resources import pools_from_config
    from rayrl.workers import RewardWorker
    from workers_cases import local_worker

    settings = [
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dir}",
        "reward_model.micro_batch_size_per_gpu=2",
        "reward.workers_per_node=2",
    ]
    cfg = load_config("grpo", settings)
    specs = pools_from_config(cfg, "cpu")
    assert [s.name for s in specs] == ["actor_rollout_ref", "reward"]
    assert specs[1].per_node == [2] and "GPU" in pools_from_config(cfg, "cuda")[1].bundle
    run = f"rm-{uuid.uuid4().hex[:6]}"
    pools = reserve_pools(specs, run, timeout_s=60)
    group = WorkerGroup(RewardWorker, pools[1].bundles, role="reward", run=run, pool=pools[1])
    try:
        group.create(timeout_s=180)
        group.init(timeout_s=300, config=cfg, tokenizer_path=str(rm_dir))
        assert len({info["pid"] for info in group.infos}) == 2
        batch = _reward_rows([ids for text in RESPONSES for ids in _variants(rm_dir, text)][:8])
        sharded = group.compute_score(batch)  # 4 rows a rank: its micro-batches as one rank's
    finally:
        group.shutdown()
        for pool in pools:
            pool.teardown()
    alone = local_worker(RewardWorker, config=cfg, tokenizer_path=str(rm_dir)).score(batch)
    assert torch.equal(sharded["scores"], alone["scores"])
    assert torch.equal(sharded["token_level_scores"], alone["token_level_scores"])
    assert len(set(sharded["scores"].tolist())) == 8  # eight different rows, in order


def _variants(rm_dir, text: str) -> list[list[int]]:
    """Token ids of `text` and of two longer variants of it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    return [tokenizer(text + tail)["input_ids"] for tail in ("", " indeed", " , surely so")]


def _reward_rows(rows: list[list[int]]):
    """A batch of responses (right-padded), each with its own prompt of PROMPTS."""
    import numpy as np

    from rayrl.batch import Batch

    width = max(len(r) for r in rows)
    responses = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, ids in enumerate(rows):
        responses[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1

    def column(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": column(["arithmetic"] * len(rows)),
            "ground_truth": column(["19"] * len(rows)),
            "extra_info": column([{}] * len(rows)),
            "raw_prompt": column([PROMPTS[i % len(PROMPTS)] for i in range(len(rows))]),
        },
    )

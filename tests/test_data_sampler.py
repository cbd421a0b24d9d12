"""verl's `data.sampler`: a sampler class of one's own orders the training epochs.

A sampler written as verl's curriculum samplers are (built with `data_source` and
`data_config`, an unseeded `RandomSampler` inside, `update(batch)` after each step)
orders the rows; the order replays for the same (seed, epoch) and the step's batch
reaches `update` once per step, in verl's shape."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rayrl.batch import Batch
from rayrl.config import ConfigError, load_config
from rayrl.models import build_tiny_model
from rayrl.trainer.contract import TrainData
from rayrl.trainer.data import load_datasets
from rayrl.trainer.ppo import PPOTrainer

SAMPLER = textwrap.dedent(
    '''
    from torch.utils.data import RandomSampler, Sampler

    class Curriculum(Sampler):
        """An unseeded random order (torch's default generator), and a record of updates."""

        def __init__(self, data_source, data_config):
            self.inner = RandomSampler(data_source)
            self.size = data_config.train_batch_size
            self.seen = []

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)

        def update(self, batch):
            self.seen.append((batch.meta_info["step"], batch.batch["scores"].tolist()))
    '''
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("s") / "m"))


def test_a_sampler_class_orders_the_epochs_replayably_and_sees_each_step(tokenizer, tmp_path):
    (tmp_path / "curriculum.py").write_text(SAMPLER)
    cfg = load_config(
        "grpo",
        [
            "data.synthetic_size=24",
            f"data.sampler.class_path={tmp_path / 'curriculum.py'}",
            "data.sampler.class_name=Curriculum",
        ],
    )
    train, _ = load_datasets(cfg, tokenizer)
    sampler = train.sampler
    size = cfg.data.train_batch_size  # the data config reached the class, as verl passes it
    assert type(sampler).__name__ == "Curriculum" and sampler.size == size
    first = train.order(0, seed=7)
    assert sorted(first) == list(range(24)) and first != list(range(24))
    assert train.order(0, seed=7) == first  # a resume or a replay reads the same order
    assert train.order(1, seed=7) != first and train.order(0, seed=8) != first
    batch = next(train.batches(2, epoch=0, seed=7))
    assert list(batch["uid"]) == [train.uids[i] for i in first[:2]]

    trainer = PPOTrainer(cfg)
    trainer.data = TrainData(train, 2)

    def scored(step: int) -> Batch:
        scores = {"scores": torch.tensor([1.0, float(step)])}
        return Batch(scores, {"uid": np.array(["a", "b"], dtype=object)}, {"step": step})

    trainer._update_sampler(0, scored(0))
    trainer._update_sampler(0, scored(0))  # the same step replayed: not again
    trainer._update_sampler(1, scored(1))
    assert sampler.seen == [(0, [1.0, 0.0]), (1, [1.0, 1.0])]


def test_sampler_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="a sampler class needs both"):
        load_config("grpo", ["data.sampler.class_path=pkg://my.samplers"])
    with pytest.raises(ConfigError, match="data.loader='ray' streams them"):
        load_config(
            "grpo",
            ["data.sampler.class_path=s.py", "data.sampler.class_name=S", "data.loader=ray"],
        )

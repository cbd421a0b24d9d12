"""Preference pairs: the columns read (verl's / OpenRLHF's names, common variants, a
conversation holding the prompt), the two encodings (a policy's rollout layout; a
reward model's whole conversation as ModelReward renders it), the pair layout of a
batch, rows set aside, the synthetic task's pairs; and the config's checks."""

from __future__ import annotations

import pytest
import torch

from rayrl.config.errors import ConfigError
from rayrl.config.pref import load_pref_config
from rayrl.data import DataError
from rayrl.data.preference import PairDataset
from rayrl.data.synthetic import preference_pairs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rayrl.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _ids(tokenizer, text)


def test_policy_pairs_are_chosen_then_rejected_rows_of_the_rollout_layout(tokenizer):
    rows = [
        {"prompt": "Which is larger, 3 or 8?", "chosen": "8", "rejected": "3"},
        {"prompt": "What is 2+2?", "chosen": "4", "rejected": "five"},
    ]
    data = PairDataset(rows, tokenizer)
    batch = data.collate([1, 0])
    assert len(data) == 2 and len(batch) == 4
    assert batch["pair_role"].tolist() == [1, 0, 1, 0]
    eos = tokenizer.eos_token
    expected = [("What is 2+2?", "4"), ("What is 2+2?", "five"), ("Which is larger, 3 or 8?", "8")]
    for row, (question, answer) in enumerate(expected):
        response = _ids(tokenizer, answer + eos)
        got = batch["responses"][row][batch["response_mask"][row].bool()].tolist()
        assert got == response
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert real == _prompt(tokenizer, question) + response


def test_scored_pairs_are_whole_conversations_as_the_reward_model_renders_them(tokenizer):
    """`encoding="score"`: the conversation ModelReward.render gives, tokenized in one
    piece, then one placeholder response token (the score is read before it)."""
    rows = [{"prompt": "Which is larger, 3 or 8?", "chosen": "8", "rejected": "3"}]
    batch = PairDataset(rows, tokenizer, encoding="score").collate([0])
    assert batch["responses"].shape[1] == 1 and batch["response_mask"].tolist() == [[1], [1]]
    for row, answer in enumerate(("8", "3")):
        messages = [
            {"role": "user", "content": "Which is larger, 3 or 8?"},
            {"role": "assistant", "content": answer},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert real[:-1] == _ids(tokenizer, text)


def test_openrlhf_conversations_and_variant_columns(tokenizer):
    """A chosen/rejected conversation ending in the assistant's message carries the
    prompt (OpenRLHF, HH-RLHF); variant names are read when the keys are the defaults."""
    conversation = [{"role": "user", "content": "Which is larger, 3 or 8?"}]
    rows = [
        {
            "chosen": [*conversation, {"role": "assistant", "content": "8"}],
            "rejected": [*conversation, {"role": "assistant", "content": "3"}],
        },
        {"question": "Which is larger, 3 or 8?", "chosen_response": "8", "rejected_response": "3"},
        {"prompt": "Which is larger, 3 or 8?", "chosen": "8", "rejected": "3"},
    ]
    data = PairDataset(rows, tokenizer)
    assert len(data) == 3 and not data.rejected
    batch = data.collate([0, 1, 2])
    assert torch.equal(batch["input_ids"][0:2], batch["input_ids"][4:6])
    assert torch.equal(batch["input_ids"][2:4], batch["input_ids"][4:6])
    own = PairDataset(
        [{"q": "Which is larger, 3 or 8?", "good": "8", "bad": "3"}],
        tokenizer,
        prompt_key="q",
        chosen_key="good",
        rejected_key="bad",
    )
    assert torch.equal(own.collate([0])["input_ids"], batch["input_ids"][4:6])


def test_unusable_rows_are_set_aside_with_reasons(tokenizer):
    rows = [
        {"prompt": "Q?", "chosen": "a"},
        {"prompt": "Q?", "chosen": "", "rejected": "b"},
        {"chosen": "a", "rejected": "b"},
        {"prompt": "Q?", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
        {"prompt": "Q?", "chosen": "a", "rejected": "b"},
    ]
    data = PairDataset(rows, tokenizer)
    assert len(data) == 1 and data.total_rows == 5
    reasons = [r.reason for r in data.rejected]
    assert "missing column 'rejected'" in reasons[0]
    assert "empty" in reasons[1]
    assert "missing column 'prompt'" in reasons[2]
    assert "assistant" in reasons[3]
    with pytest.raises(DataError, match="fewer than one batch|usable"):
        data.require_rows(2)


def test_truncation(tokenizer):
    rows = [{"prompt": "Which is larger, 31 or 47? " * 4, "chosen": "47", "rejected": "31"}]
    with pytest.raises(DataError, match="data.max_length=16"):
        PairDataset(rows, tokenizer, max_length=16)
    for encoding in ("policy", "score"):
        data = PairDataset(rows, tokenizer, max_length=16, truncation="left", encoding=encoding)
        batch = data.collate([0])
        limit = 16 + (1 if encoding == "score" else 0)  # the placeholder comes on top
        assert int(batch["attention_mask"].sum(-1).max()) <= limit


def test_synthetic_pairs_are_right_against_wrong_and_held_out():
    train, val = preference_pairs("larger", 64, seed=3, val_size=32)
    assert len(train) == 64 and 0 < len(val) <= 32
    typical = larger_than_right = 0
    for row in train + val:
        question = row["extra_info"]["question"]
        a, b = (
            int(x) for x in question.removeprefix("Which is larger, ").rstrip("?").split(" or ")
        )
        assert row["chosen"] == str(max(a, b)) and row["rejected"] != row["chosen"]
        if row["extra_info"]["typical_mistake"]:
            typical += 1
            assert row["rejected"] == str(min(a, b))
        larger_than_right += int(row["rejected"]) > max(a, b)
    # both kinds of wrong answer; a larger number is not always the better one
    assert 0 < typical < len(train) + len(val) and larger_than_right > 0
    seen = {r["extra_info"]["question"] for r in train}
    assert not any(r["extra_info"]["question"] in seen for r in val)


def test_config_defaults_and_checks():
    rm, dpo = load_pref_config("rm", "demo"), load_pref_config("dpo", "demo")
    assert (rm.objective.name, dpo.objective.name) == ("bt", "dpo")
    assert load_pref_config("dpo", None, ["objective.name=ipo"]).objective.name == "ipo"
    with pytest.raises(ConfigError, match="`rayrl dpo` runs it"):
        load_pref_config("rm", None, ["objective.name=dpo"])
    with pytest.raises(ConfigError, match="`rayrl rm` runs it"):
        load_pref_config("dpo", None, ["objective.name=bt"])
    with pytest.raises(ConfigError, match="objective.name"):
        load_pref_config("dpo", None, ["objective.name=dpoo"])
    with pytest.raises(ConfigError, match="objective.beta"):
        load_pref_config("dpo", None, ["objective.beta=0"])
    with pytest.raises(ConfigError, match="label_smoothing"):
        load_pref_config("dpo", None, ["objective.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="micro_batch_size_per_gpu=3 pairs"):
        load_pref_config(
            "dpo", "demo", ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=3"]
        )
    with pytest.raises(ConfigError, match="did you mean"):
        load_pref_config("dpo", None, ["data.chosen_kye=x"])

"""SFT data: verl's prompt/response columns to batches whose response columns are the
response and nothing else; bad rows set aside with file, row and reason; truncation."""

from __future__ import annotations

import pytest
import torch

from rayrl.data import DataError, RowSource, write_parquet
from rayrl.data.sft import SFTDataset
from rayrl.data.synthetic import demonstrations, held_out_rows, synthetic_rows


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rayrl.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def _chat(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_collated_layout_is_prompt_then_response(tokenizer):
    rows = [
        {"question": "What is 2+2?", "answer": "4"},
        {
            "question": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Which is larger, 3 or 8?"},
            ],
            "answer": "8",
        },
    ]
    data = SFTDataset(rows, tokenizer)
    batch = data.collate([0, 1])
    prompts = [
        _chat(tokenizer, [{"role": "user", "content": "What is 2+2?"}]),
        _chat(tokenizer, rows[1]["question"]),
    ]
    responses = [
        tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for a in "48"
    ]
    width_p = max(map(len, prompts))
    for i in range(2):
        mask = batch["attention_mask"][i].bool()
        assert batch["input_ids"][i][mask].tolist() == prompts[i] + responses[i]
        assert batch["responses"][i][batch["response_mask"][i].bool()].tolist() == responses[i]
        assert not mask[: width_p - len(prompts[i])].any()  # prompts are left-padded
    assert torch.equal(batch["responses"], batch["input_ids"][:, width_p:])
    assert batch["response_mask"].sum().item() == sum(map(len, responses))
    assert responses[0][-1] == tokenizer.eos_token_id  # the model learns to stop


def test_nested_columns_and_bad_rows_set_aside(tokenizer):
    rows = [
        {"extra_info": {"question": "q1", "answer": "a1"}},
        {"extra_info": {"question": "q2"}},
        {"extra_info": {"question": "", "answer": "a3"}},
        {"extra_info": {"question": [{"role": "robot", "content": "x"}], "answer": "a4"}},
        {"extra_info": {"question": "q5", "answer": 5}},
        {"other": 1},
    ]
    sources = [RowSource("f.parquet", i) for i in range(len(rows))]
    data = SFTDataset(
        rows,
        tokenizer,
        prompt_key="extra_info",
        response_key="extra_info",
        prompt_dict_keys=["question"],
        response_dict_keys=["answer"],
        sources=sources,
    )
    assert len(data) == 1
    reasons = {r.source.row: r.reason for r in data.rejected}
    assert "no 'answer' in column 'extra_info'" in reasons[1]
    assert "empty string" in reasons[2]
    assert "role 'robot'" in reasons[3]
    assert "non-empty string" in reasons[4]
    assert "missing column 'extra_info'" in reasons[5]
    assert str(data.rejected[0]).startswith("f.parquet row 1:")
    with pytest.raises(
        DataError, match=r"1 usable rows \(of 6; 5 set aside, first: f.parquet row 1"
    ):
        data.require_rows(2)


def test_truncation(tokenizer):
    row = {"question": "What is 12+7? Answer with the number only.", "answer": "19 is the answer"}
    full = SFTDataset([row], tokenizer)
    p, r = len(full.prompt_ids[0]), len(full.response_ids[0])
    with pytest.raises(DataError, match=rf"row 0: prompt {p} \+ response {r} = {p + r} tokens"):
        SFTDataset([row], tokenizer, max_length=p + r - 1)
    right = SFTDataset([row], tokenizer, max_length=p + 2, truncation="right")
    assert (
        right.prompt_ids[0] == full.prompt_ids[0]
        and right.response_ids[0] == full.response_ids[0][:2]
    )
    left = SFTDataset([row], tokenizer, max_length=r + 3, truncation="left")
    assert (
        left.prompt_ids[0] == full.prompt_ids[0][-3:]
        and left.response_ids[0] == full.response_ids[0]
    )
    aside = SFTDataset([row], tokenizer, max_length=p, truncation="right")
    assert len(aside) == 0 and "fills data.max_length" in aside.rejected[0].reason


def test_demonstrations_are_the_training_questions(tmp_path):
    demos = demonstrations("larger", 200, seed=3, correct_rate=0.4)
    rows = synthetic_rows("larger", 200, seed=3)
    assert [d["question"] for d in demos] == [r["prompt"][0]["content"] for r in rows]
    right = [d["extra_info"]["correct"] for d in demos]
    assert 0.3 < sum(right) / len(right) < 0.5
    for demo in demos:  # a wrong demonstration names the smaller number
        a, b = (int(x) for x in demo["question"].split("larger, ")[1].split("?")[0].split(" or "))
        assert demo["answer"] == str(max(a, b) if demo["extra_info"]["correct"] else min(a, b))
    held = held_out_rows("larger", 200, 50, seed=3)
    assert held and not {str(r["prompt"]) for r in held} & {str(r["prompt"]) for r in rows}
    assert demonstrations("larger", 200, seed=3, correct_rate=0.4) == demos  # seeded
    path = write_parquet(demos, tmp_path / "demos.parquet")  # verl's SFT columns, in parquet
    from rayrl.data import read_parquet

    assert read_parquet(path)[0]["question"] == demos[0]["question"]

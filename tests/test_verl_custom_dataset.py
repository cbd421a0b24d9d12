"""verl's `data.custom_cls`: a dataset class of one's own, loaded from a file path and
built as verl builds it, is what training and validation read (`rayrl.data.custom`)."""

from __future__ import annotations

import json
import textwrap

import pytest

from engine_cases import tiny_model_dir  # noqa: F401 (fixture)
from rayrl.config import ConfigError, load_config
from rayrl.data import DataError
from rayrl.models.loading import load_tokenizer
from rayrl.trainer.data import load_datasets

# A class written against verl's contract: (data_files, tokenizer, processor, config,
# max_samples), a torch Dataset whose rows carry `raw_prompt` and a dummy tensor.
CLASS = """
import json
import torch
from torch.utils.data import Dataset


class WordProblems(Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        self.rows = [json.loads(l) for f in data_files for l in open(f)]
        self.system = config.get("system_prompt", "Think step by step.")
        self.limit = config.max_prompt_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return {
            "raw_prompt": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": "Q: " + row["q"]},
            ],
            "data_source": "word_problems",
            "reward_model": {"style": "rule", "ground_truth": row["a"]},
            "extra_info": {"index": i, "limit": self.limit},
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
        }


class NoMessages(WordProblems):
    def __getitem__(self, i):
        return {"question": self.rows[i]["q"], "data_source": "x"}
"""


@pytest.fixture
def user_files(tmp_path):
    module = tmp_path / "my_dataset.py"
    module.write_text(textwrap.dedent(CLASS))
    files = []
    for name, items in (("train", [("1+1", "2"), ("2+3", "5")]), ("val", [("4+4", "8")])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in items))
        files.append(path)
    return module, *files


def config(module, train, val, name="WordProblems", *extra):
    return load_config(
        "grpo",
        [
            f"data.train_files={train}",
            f"data.val_files={val}",
            f"data.custom_cls.path={module}",
            f"data.custom_cls.name={name}",
            "data.max_prompt_length=200",
            *extra,
        ],
        warn=lambda message: None,
    )


def test_the_class_rows_are_what_training_and_validation_read(user_files, tiny_model_dir):  # noqa: F811
    module, train_file, val_file = user_files
    cfg = config(module, train_file, val_file)
    tokenizer = load_tokenizer(tiny_model_dir, key="model.path")
    train, val = load_datasets(cfg, tokenizer)
    assert len(train) == 2 and len(val) == 1
    batch = train.collate([0, 1])
    assert [m[-1]["content"] for m in batch.non_tensors["raw_prompt"]] == ["Q: 1+1", "Q: 2+3"]
    assert list(batch.non_tensors["ground_truth"]) == ["2", "5"]
    assert batch.non_tensors["extra_info"][1] == {"index": 1, "limit": 200}  # config read
    assert "dummy_tensor" not in train.rows[0]
    expected = tokenizer.apply_chat_template(
        batch.non_tensors["raw_prompt"][0], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(train.prompt_ids[0]) == expected
    assert val.collate([0]).non_tensors["raw_prompt"][0][-1]["content"] == "Q: 4+4"


def test_a_row_without_messages_is_named(user_files, tiny_model_dir):  # noqa: F811
    module, train_file, val_file = user_files
    cfg = config(module, train_file, val_file, "NoMessages")
    tokenizer = load_tokenizer(tiny_model_dir, key="model.path")
    with pytest.raises(DataError, match=r"NoMessages\[0\] has neither 'raw_prompt' nor 'prompt'"):
        load_datasets(cfg, tokenizer)


def test_custom_cls_needs_a_name_and_the_default_loader(user_files):
    module, train_file, val_file = user_files
    with pytest.raises(ConfigError, match="needs data.custom_cls.name"):
        load_config("grpo", [f"data.train_files={train_file}", f"data.custom_cls.path={module}"])
    with pytest.raises(ConfigError, match="use data.loader=default"):
        config(module, train_file, val_file, "WordProblems", "data.loader=ray")

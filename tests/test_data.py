"""Prompt data: synthetic rows, parquet round trip, tokenization, rejected rows, batches."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rayrl.data import PromptDataset, read_parquet, synthetic_rows, write_parquet
from rayrl.models import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=32)
    return AutoTokenizer.from_pretrained(path)


def test_synthetic_rows_are_verl_rows_and_deterministic():
    rows = synthetic_rows("arithmetic", 20, seed=3)
    assert rows == synthetic_rows("arithmetic", 20, seed=3)
    assert rows != synthetic_rows("arithmetic", 20, seed=4)
    row = rows[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    q = row["extra_info"]["question"]
    assert (
        str(eval(q.removeprefix("What is ").removesuffix("?")))
        == row["reward_model"]["ground_truth"]
    )
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic_rows("nope")


def test_parquet_round_trip(tmp_path):
    rows = synthetic_rows(size=10)
    path = write_parquet(rows, tmp_path / "d" / "train.parquet")
    assert read_parquet(path) == rows
    assert read_parquet([path, path]) == rows + rows
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_parquet(tmp_path / "missing.parquet")


def test_collate_left_pads_and_carries_columns(tokenizer):
    ds = PromptDataset(synthetic_rows(size=6), tokenizer, max_prompt_length=64)
    batch = ds.collate([0, 1, 2])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and len(batch) == 3
    for row in range(3):
        n = int(mask[row].sum())
        assert mask[row, -n:].all() and not mask[row, : ids.shape[1] - n].any()
        assert ids[row, -n:].tolist() == ds.prompt_ids[row]
        assert batch["position_ids"][row, -n:].tolist() == list(range(n))
    assert list(batch["uid"]) == ["p0", "p1", "p2"]
    text = tokenizer.decode(ds.prompt_ids[0])
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert batch["ground_truth"][0] == synthetic_rows(size=6)[0]["reward_model"]["ground_truth"]


def test_malformed_and_overlong_rows_are_set_aside_with_reasons(tokenizer):
    rows = synthetic_rows(size=4)
    rows[1] = {"prompt": "not messages", "data_source": "x", "reward_model": {"ground_truth": 1}}
    rows[2] = {"data_source": "x"}
    long = dict(rows[3], prompt=[{"role": "user", "content": "1+1 " * 200}])
    ds = PromptDataset([*rows, long], tokenizer, max_prompt_length=64)
    assert len(ds) == 2 and ds.positions == [0, 3]
    reasons = {r.index: r.reason for r in ds.rejected}
    assert "list of {role, content} messages" in reasons[1]
    assert "missing column(s) reward_model, prompt" in reasons[2]
    assert "over data.max_prompt_length=64" in reasons[4]
    with pytest.raises(ValueError, match="data.truncation=left"):
        PromptDataset([long], tokenizer, max_prompt_length=64, filter_overlong=False)
    left = PromptDataset([long], tokenizer, max_prompt_length=64, truncation="left")
    assert len(left.prompt_ids[0]) == 64 and left.prompt_ids[0][-3:] == ds.prompt_ids[0][-3:]
    assert ds.truncated == 0
    cut = PromptDataset([rows[0], long, long], tokenizer, max_prompt_length=64, truncation="left")
    assert cut.truncated == 2 and len(cut) == 3  # counted for the run's summary line


def test_epoch_order_is_seeded_and_batches_resume(tokenizer):
    ds = PromptDataset(synthetic_rows(size=10), tokenizer, max_prompt_length=64)
    assert ds.order(0, seed=1) == ds.order(0, seed=1)
    assert ds.order(0, seed=1) != ds.order(1, seed=1)
    assert sorted(ds.order(2, seed=1)) == list(range(10))
    full = list(ds.batches(3, epoch=0, seed=1))
    assert len(full) == 3
    resumed = list(ds.batches(3, epoch=0, seed=1, start=1))
    assert all(a.equals(b) for a, b in zip(full[1:], resumed, strict=True))


def _row(prompt, ground_truth="4", **extra):
    return {
        "data_source": "arithmetic",
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        **extra,
    }


def test_each_bad_row_kind_is_set_aside_with_file_row_and_reason(tokenizer, tmp_path):
    from rayrl.data import read_rows_with_sources

    good = [{"role": "user", "content": "What is 2+2?"}]
    first = write_parquet([_row(good), _row([]), _row(good, None)], tmp_path / "a.parquet")
    second = write_parquet(
        [
            _row([{"role": "user", "content": "  "}]),
            _row(good),
            _row([{"role": "bot", "content": "hi"}]),
            _row(good),
        ],
        tmp_path / "b.parquet",
    )
    rows, sources = read_rows_with_sources([first, second])
    ds = PromptDataset(rows, tokenizer, max_prompt_length=64, sources=sources)
    assert len(ds) == 3  # the run goes on with the good rows
    found = [str(r) for r in ds.rejected]
    assert found == [
        f"{first} row 1: 'prompt' has no messages",
        f"{first} row 2: reward_model.ground_truth is null (nothing to score against)",
        f"{second} row 0: 'prompt' message 0 (user) has empty content",
        f"{second} row 2: 'prompt' message 0 has role 'bot' (expected one of system, user, "
        "assistant, tool)",
    ]


def test_fewer_usable_rows_than_a_batch_fail_at_load_with_both_numbers(tokenizer):
    from rayrl.data import DataError

    rows = [_row([{"role": "user", "content": "1+1?"}]), _row([])]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=64)
    with pytest.raises(
        DataError, match=r"1 usable rows \(of 2; 1 set aside.*one batch of data.train_batch_size=4"
    ):
        ds.require_rows(4)


def test_trainer_refuses_too_little_data_before_reserving_anything(tmp_path):
    from rayrl.config import load_config
    from rayrl.data import DataError
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    data = write_parquet([_row([{"role": "user", "content": "1+1?"}])] * 3, tmp_path / "t.parquet")
    cfg = load_config("grpo", [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"])
    run = Run(PPOTrainer(cfg))
    with pytest.raises(DataError, match=r"3 usable rows \(of 3\).*data.train_batch_size=8"):
        run.setup()
    assert run.pools == [] and run.kv is None and run.groups == []


def test_every_row_set_aside_is_listed_in_the_run_directory(tmp_path):
    """Not only the first bad row on the console: all of them in rejected_rows.jsonl,
    a summary by reason on screen, and the file named when too few rows are left."""
    import json

    from rayrl.config import load_config
    from rayrl.data import DataError
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    good = _row([{"role": "user", "content": "1+1?"}])
    rows = [good, _row([]), good, _row([{"role": "user", "content": " "}]), good, _row([])]
    data = write_parquet(rows, tmp_path / "t.parquet")
    said: list[str] = []

    def run(batch: int) -> Run:
        cfg = load_config(
            "grpo",
            [
                f"actor_rollout_ref.model.path={model}",
                f"data.train_files={data}",
                f"data.train_batch_size={batch}",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
                f"trainer.output_dir={tmp_path / 'out'}",
            ],
        )
        return Run(PPOTrainer(cfg, print_fn=said.append))

    small = run(2)
    small.run_dir.prepare("")
    assert len(small._load_data().dataset) == 3
    listed = [json.loads(line) for line in small.run_dir.rejected_rows.read_text().splitlines()]
    assert [(r["split"], r["file"], r["row"]) for r in listed] == [
        ("train", str(data), 1),
        ("train", str(data), 3),
        ("train", str(data), 5),
    ]
    assert all(r["reason"] for r in listed)
    [warning] = said
    assert "3 of 6 train rows set aside" in warning and "rejected_rows.jsonl" in warning
    assert "2 x 'prompt' has no messages (" in warning and "t.parquet row 5" in warning
    with pytest.raises(DataError, match=r"fewer than one batch.*listed in .*rejected_rows"):
        run(8)._load_data()


def test_a_bad_row_of_a_later_file_is_listed_with_its_row_in_that_file(tmp_path):
    """Two training files (Parquet, then JSON Lines) and two validation files: each row
    set aside is listed in rejected_rows.jsonl under its own file and its row number in
    that file, not its index in the rows of all files together."""
    import json

    from rayrl.config import load_config
    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    good = _row([{"role": "user", "content": "1+1?"}])
    empty = _row([])
    first = write_parquet([good, good, empty, good], tmp_path / "first.parquet")
    second = tmp_path / "second.jsonl"
    second.write_text("".join(json.dumps(r) + "\n" for r in [good, empty, good, good, empty]))
    val_a = write_parquet([empty, good], tmp_path / "val_a.parquet")
    val_b = write_parquet([good, good, good, empty], tmp_path / "val_b.parquet")
    cfg = load_config(
        "grpo",
        [
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{first},{second}]",
            f"data.val_files=[{val_a},{val_b}]",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"trainer.output_dir={tmp_path / 'out'}",
        ],
    )
    run = Run(PPOTrainer(cfg, print_fn=lambda line: None))
    run.run_dir.prepare("")
    assert len(run._load_data().dataset) == 6
    listed = [json.loads(line) for line in run.run_dir.rejected_rows.read_text().splitlines()]
    assert [(r["split"], r["file"], r["row"], r["index"]) for r in listed] == [
        ("train", str(first), 2, 2),
        ("train", str(second), 1, 5),
        ("train", str(second), 4, 8),
        ("val", str(val_a), 0, 0),
        ("val", str(val_b), 3, 5),
    ]


def test_a_model_directory_without_a_tokenizer_is_named_at_load(tmp_path):
    """transformers builds an empty tokenizer from such a directory, and every row was
    then set aside with advice about the data; the missing tokenizer is said first."""
    from rayrl.config import load_config
    from rayrl.models.loading import TOKENIZER_FILES, TokenizerMissingError
    from rayrl.trainer.ppo import PPOTrainer

    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    for path in model.iterdir():
        if path.name in TOKENIZER_FILES or path.name.startswith(("tokenizer", "special_tokens")):
            path.unlink()
    cfg = load_config("grpo", [f"actor_rollout_ref.model.path={model}"])
    with pytest.raises(
        TokenizerMissingError, match=r"actor_rollout_ref.model.path=.* no tokenizer"
    ):
        PPOTrainer(cfg).load_data()


def test_model_paths_are_checked_before_anything_loads_them(tmp_path):
    """A local directory passes; a missing directory, a file, a `~` the shell left, or a
    path a hub name cannot be, fails with the key; a hub name is left to transformers."""
    from rayrl.models.loading import ModelPathError, check_model_path

    check_model_path(tmp_path, key="k")
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "org/model.v2-x_y"):
        check_model_path(name, key="k")  # no request is made: only the shape is read
    (tmp_path / "config.json").write_text("{}")
    cases = {
        str(tmp_path / "absent"): "k=.*absent: no such directory",
        str(tmp_path / "config.json"): "is a file, not a model directory",
        "~/models/qwen": "'~' is not expanded",
        "a/b/c": "no such directory",
        "../qwen": "no such directory",
    }
    for path, says in cases.items():
        with pytest.raises(ModelPathError, match=says):
            check_model_path(path, key="k")


def test_data_files_are_read_as_verl_reads_them(tmp_path):
    """.jsonl and .json as JSON (objects per line, a list of objects, an object of
    columns), anything else as Parquet; what is not what its name says is a DataError
    naming the file and the line."""
    import json as json_

    from rayrl.data import DataError
    from rayrl.data.dataset import read_rows_with_sources
    from rayrl.data.files import read_rows

    rows = [{"a": 1, "b": {"c": [1, 2]}}, {"a": 2, "b": {"c": []}}]
    (tmp_path / "r.jsonl").write_text("".join(json_.dumps(r) + "\n\n" for r in rows))
    (tmp_path / "list.json").write_text(json_.dumps(rows))
    (tmp_path / "columns.json").write_text(
        json_.dumps({"a": [1, 2], "b": [{"c": [1, 2]}, {"c": []}]})
    )
    (tmp_path / "lines.json").write_text("\n".join(json_.dumps(r) for r in rows))
    for name in ("r.jsonl", "list.json", "columns.json", "lines.json"):
        assert read_rows(tmp_path / name) == rows, name
    got, sources = read_rows_with_sources([str(tmp_path / "r.jsonl"), str(tmp_path / "list.json")])
    assert got == rows + rows and str(sources[3]) == f"{tmp_path / 'list.json'} row 1"
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not JSON"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "scalar.jsonl").write_text("3\n")
    with pytest.raises(DataError, match="line 1 is a JSON int, not an object"):
        read_rows(tmp_path / "scalar.jsonl")
    (tmp_path / "ragged.json").write_text(json_.dumps({"a": [1, 2], "b": [1]}))
    with pytest.raises(DataError, match="neither a list of row objects"):
        read_rows(tmp_path / "ragged.json")
    (tmp_path / "rows.txt").write_text('{"a": 1}\n')
    with pytest.raises(DataError, match="rows.txt is not a Parquet file.*named .json or .jsonl"):
        read_rows(tmp_path / "rows.txt")

"""What was generated, kept: verl's `trainer.rollout_data_dir` and
`trainer.validation_data_dir` (`rayrl.trainer.generations`), as the writer makes their
rows, as a validation and `rayrl train` write them, and as `rayrl report` shows them.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from rayrl.batch import Batch
from rayrl.config import load_config, to_yaml
from rayrl.trainer.generations import (
    VERSIONS,
    GenerationsDir,
    generation_rows,
    oldest_versions,
    read_generations,
    write_training_step,
)
from rayrl.trainer.report import write_report
from rayrl.trainer.run_dir import RunDirError
from rayrl.trainer.validate import Validator
from rayrl.workers.context import StageResult
from test_cli_commands import _grpo_train, gcs, gsm8k_parquet, rayrl, tiny_model  # noqa: F401
from test_config_verl import verl_overrides
from verl_examples import SCRIPTS

PAD = 0
FIELDS = {"input", "output", "gts", "score", "step", "uid", "weight_version"}


def decode(rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
    """A tokenizer's `batch_decode` where token t is the letter chr(96 + t)."""
    assert skip_special_tokens
    return ["".join(chr(96 + t) for t in row) for row in rows]


def samples(versions: list[list[int]] | None = None, turns: bool = False) -> Batch:
    """Two generated, scored samples: prompts "ab" and "c" (left-padded), responses
    "de" and "fgh" (right-padded); with `turns`, multi-turn ones whose second response
    token is a tool's (out of the response mask)."""
    prompts = torch.tensor([[1, 2], [PAD, 3]])
    responses = torch.tensor([[4, 5, PAD, PAD], [6, 7, 8, PAD]])
    attention = torch.cat([prompts != PAD, responses != PAD], dim=1).long()
    response_mask = (responses != PAD).long()
    if turns:
        response_mask[:, 1] = 0
    columns = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention,
        "response_mask": response_mask,
        "scores": torch.tensor([1.0, 0.0]),
        "uid": np.array(["p0", "p1"], dtype=object),
        "ground_truth": np.array(["5", "7"], dtype=object),
        "reward_extra": np.array([{"acc": 1.0}, {"acc": 0.0, "score": 9}], dtype=object),
    }
    if versions is not None:
        columns[VERSIONS] = torch.tensor(versions)
    batch = Batch.from_dict(columns)
    if turns:
        batch.non_tensors["trajectory"] = np.empty(2, dtype=object)
        batch.non_tensors["trajectory"][:] = [
            [
                {"role": "user", "content": "ab"},
                {"role": "assistant", "content": "d", "tool_calls": [{"name": "calc"}]},
                {"role": "tool", "content": "e"},
            ],
            [{"role": "user", "content": "c"}, {"role": "assistant", "content": "fgh"}],
        ]
        batch["num_turns"] = np.array([3, 2], dtype=object)
    return batch


def test_rows_of_single_turn_samples_carry_verls_fields_and_the_steps_version():
    rows = generation_rows(samples(), decode, step=4, version=3)
    assert [(r["input"], r["output"]) for r in rows] == [("ab", "de"), ("c", "fgh")]
    assert all(set(r) >= FIELDS and "turns" not in r for r in rows)
    assert [(r["score"], r["uid"], r["gts"], r["step"]) for r in rows] == [
        (1.0, "p0", "5", 4),
        (0.0, "p1", "7", 4),
    ]
    assert [r["weight_version"] for r in rows] == [3, 3]
    assert rows[0]["acc"] == 1.0 and rows[1]["score"] == 0.0  # an extra never replaces one


def test_rows_of_multi_turn_samples_carry_their_turns_and_oldest_version():
    mixed = [[0, 0, 2, 2], [3, 1, 3, 1]]  # row 1: a tool token and padding at version 1
    rows = generation_rows(samples(mixed, turns=True), decode, step=5, version=4)
    assert rows[0]["weight_version"] == 0  # the oldest of the row's response tokens
    assert rows[1]["weight_version"] == 3  # the tool's token and the padding do not count
    assert rows[0]["output"] == "de"  # the whole response, the tool's answer included
    assert rows[0]["num_turns"] == 3 and rows[1]["num_turns"] == 2
    assert rows[0]["turns"][1]["tool_calls"] == [{"name": "calc"}]
    assert rows[0]["turns"][2] == {"role": "tool", "content": "e"}


def test_oldest_versions_fall_back_to_the_whole_row_without_response_tokens():
    versions = torch.tensor([[0, 0, 2, 2], [5, 4, 6, 6]])
    assert oldest_versions(versions, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])) == [0, 4]


def test_a_training_step_writes_its_global_step_as_json_lines(tmp_path):
    directory = GenerationsDir(tmp_path / "rollouts", "trainer.rollout_data_dir").prepare()
    metrics = write_training_step(directory, samples(), decode, index=0)
    assert metrics["timing_s/dump_rollout_generations"] >= 0
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").open()]
    assert [(r["step"], r["weight_version"], r["output"]) for r in rows] == [
        (1, 0, "de"),
        (1, 0, "fgh"),
    ]
    write_training_step(directory, samples()[:1], decode, index=0)  # the step run again
    assert len((tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()) == 1
    assert [s for s, _ in read_generations(tmp_path / "rollouts", 3, 2)] == [1]


def test_a_relative_directory_is_the_working_directorys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert GenerationsDir("dumps/r", "k").path == tmp_path / "dumps" / "r"


def test_a_directory_that_cannot_be_made_names_its_key(tmp_path):
    (tmp_path / "file").write_text("")
    directory = GenerationsDir(tmp_path / "file" / "rollouts", "trainer.rollout_data_dir")
    with pytest.raises(RunDirError, match="cannot write trainer.rollout_data_dir=") as err:
        directory.prepare()
    assert "set trainer.rollout_data_dir to a directory" in str(err.value)


class Prompts:
    """Three validation prompts as the dataset collates them."""

    def __len__(self) -> int:
        return 3

    def collate(self, indices: list[int]) -> Batch:
        return Batch.from_dict(
            {
                "uid": np.array([f"q{i}" for i in indices], dtype=object),
                "raw_prompt": np.array([f"prompt {i}" for i in indices], dtype=object),
                "data_source": np.array(["toy"] * len(indices), dtype=object),
                "ground_truth": np.array(["5"] * len(indices), dtype=object),
            }
        )


def test_a_validation_writes_all_its_samples_to_validation_data_dir(tmp_path):
    def generate(prompts, ctx):
        out = samples()[: len(prompts)]
        for key in ("uid", "raw_prompt", "data_source", "ground_truth"):
            out.non_tensors[key] = prompts[key]
        return StageResult(out)

    def score(batch):
        return samples()[: len(batch)].select("scores", "reward_extra")

    data_dir = GenerationsDir(tmp_path / "val", "trainer.validation_data_dir")
    val_generations = tmp_path / "val_generations"
    validator = Validator(
        Prompts(),
        generate,
        score,
        decode,
        n=1,
        batch_size=2,
        examples=1,
        out_dir=val_generations,
        data_dir=data_dir,
    )
    validator.run(step=6)
    rows = [json.loads(line) for line in (tmp_path / "val" / "6.jsonl").open()]
    assert [r["uid"] for r in rows] == ["val/q0", "val/q1", "val/q2"]  # all, not 1
    assert all(r["step"] == 6 and r["weight_version"] == 6 for r in rows)
    assert len((val_generations / "step_6.jsonl").read_text().splitlines()) == 1


def test_the_keys_are_the_schemas_and_verls_scripts_that_set_them_load(tmp_path):
    script = SCRIPTS["examples/grpo_trainer/run_qwen2-7b.sh"]
    extra = [
        f"trainer.rollout_data_dir={tmp_path}/rollout",
        f"trainer.validation_data_dir={tmp_path}/validation",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, [*verl_overrides(script, str(tmp_path)), *extra])
    assert not [w for w in caught if "_data_dir" in str(w.message)]
    assert cfg.trainer.rollout_data_dir == f"{tmp_path}/rollout"
    assert cfg.trainer.validation_data_dir == f"{tmp_path}/validation"
    assert load_config("grpo").trainer.rollout_data_dir is None  # off by default


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    """A run directory `outputs/run` (relative output_dir, started in `tmp_path`) whose
    rollouts went to the relative `dumps/` with `rows` at steps 1 to 4."""
    with contextlib.chdir(tmp_path):  # the run starts there (its paths are made absolute)
        cfg = load_config(
            "grpo", ["trainer.output_dir=outputs/run", "trainer.rollout_data_dir=dumps"]
        )
    run = tmp_path / "outputs" / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    (tmp_path / "dumps").mkdir()
    for step in range(1, 5):
        text = "".join(json.dumps({**r, "step": step}) + "\n" for r in rows)
        (tmp_path / "dumps" / f"{step}.jsonl").write_text(text)
    return run


def test_the_report_shows_a_few_generations_of_the_last_steps_escaped(tmp_path, monkeypatch):
    rows = [
        {"input": "2+2?", "output": "<script>x</script>4", "score": 1.0, "uid": "a"},
        {"input": "p", "output": "r", "score": 0.0, "uid": "b", "weight_version": 1},
        {"input": "third", "output": "not shown", "score": 0.0, "uid": "c"},
    ]
    run = _run_dir(tmp_path, rows)
    monkeypatch.chdir(run)  # the report finds the run's own working directory
    page = write_report(run).read_text()
    assert "<h3>Step 1</h3>" not in page and "<h3>Step 4</h3>" in page
    assert page.count("&lt;script&gt;x&lt;/script&gt;4") == 3 and "<script>" not in page
    assert "policy version 1" in page and "not shown" not in page


def test_the_report_shows_an_agents_turns(tmp_path):
    turns = [
        {"role": "user", "content": "add <1> and 2"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "args": "1+2"}]},
        {"role": "tool", "name": "calc", "content": "3"},
    ]
    row = {"input": "i", "output": "o", "score": 1, "uid": "a", "turns": turns, "num_turns": 3}
    page = write_report(_run_dir(tmp_path, [row])).read_text()
    assert "[user] add &lt;1&gt; and 2" in page and "[tool calc] 3" in page
    assert "tool call: {&quot;name&quot;: &quot;calc&quot;" in page and "3 turns" in page


@pytest.mark.command
@pytest.mark.slow
@pytest.mark.timeout(900)  # a run in a process of its own, on a loaded 2-core machine
def test_train_writes_rollouts_and_validations_that_the_report_shows(
    tmp_path,
    monkeypatch,
    tiny_model,  # noqa: F811
    gsm8k_parquet,  # noqa: F811
    gcs,  # noqa: F811
):
    """Two GRPO steps (2 prompts x 2 samples), validation at step 2 on the 8 rows; the
    rollouts' directory relative to the working directory, as verl's."""
    run = tmp_path / "run"
    done = rayrl(
        *_grpo_train(tiny_model, gsm8k_parquet),
        f"data.val_files={gsm8k_parquet[0]}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.rollout_data_dir=dumps/rollout",
        f"trainer.validation_data_dir={tmp_path}/validation",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.export_hf=false",
        f"trainer.output_dir={run}",
        f"resources.address={gcs}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in (1, 2):
        rows = [json.loads(line) for line in (tmp_path / f"dumps/rollout/{step}.jsonl").open()]
        assert len(rows) == 4 and all(FIELDS - {"gts"} <= set(r) for r in rows)
        assert {(r["step"], r["weight_version"]) for r in rows} == {(step, step - 1)}
    rows = [json.loads(line) for line in (tmp_path / "validation" / "2.jsonl").open()]
    assert len(rows) == 8 and all(r["step"] == 2 and r["gts"] for r in rows)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert "timing_s/dump_rollout_generations" in metrics[-1]
    monkeypatch.chdir(tmp_path)  # `rayrl report` where the run was started
    page = write_report(run).read_text()
    assert "<h3>Step 2</h3>" in page and "dumps/rollout" in page

"""The Python API (`from rayrl import GRPOTrainer`): TRL-style reward functions and
datasets train through real Ray and the reward rises; a first Ctrl-C ends `train()`
with a checkpoint; mistakes are refused in the constructor, before Ray, naming what to
fix; in-memory datasets become the same parquet files whatever their container; reward
functions get the dataset's other columns, through the path the reward workers take."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rayrl import GRPOTrainer
from rayrl.config import load_config
from rayrl.config.errors import ConfigError
from rayrl.data.files import read_rows
from rayrl.data.synthetic import synthetic_rows
from rayrl.rewards.loader import RewardFunctionError, resolve_function, spec_from_config

# As tests/test_trainer_learning.py sizes a run that learns in a dozen CPU steps.
SMALL = {
    "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,
    "trainer.device": "cpu",
    "trainer.logger": [],
}
TRL_SETTINGS = dict(
    learning_rate=1e-2, num_generations=4, max_completion_length=8, seed=1, beta=0.0
)


def larger_rows(size: int = 256) -> list[dict]:
    """`rayrl demo`'s task ("Which is larger, 31 or 47?") in TRL's columns."""
    return [
        {"prompt": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"]}
        for r in synthetic_rows("larger", size, seed=1)
    ]


def exact(completions, answer, **kwargs):
    """The demo's reward, TRL's style: 1 for the right number."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def digit_share(scale: float):
    """A closure (pickled by value): `scale` x the share of digits in the answer, the
    shaping a random tiny model can learn in a dozen steps (the exact reward alone
    needs the demo's SFT stage first)."""

    def digits(completions, **kwargs):
        texts = [c.replace(" ", "") for c in completions]
        return [scale * sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]

    return digits


def test_trl_style_rewards_and_rows_train_through_ray_and_the_reward_rises(ray_local, tmp_path):
    trainer = GRPOTrainer(
        reward_funcs=[exact, digit_share(2.0)],
        train_dataset=larger_rows(),
        reward_weights=[1.0, 0.5],
        output_dir=tmp_path,
        max_steps=12,
        print_fn=lambda line: None,
        **TRL_SETTINGS,
        **SMALL,
    )
    result = trainer.train()
    scores = [m["critic/score/mean"] for m in result.history]
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert len(scores) == 12 and end >= start + 0.15, f"the reward did not rise: {scores}"
    for m in result.history:  # the sum of both, each reported on its own too
        assert m["reward/score/mean"] == pytest.approx(
            m["reward/exact/mean"] + 0.5 * m["reward/digits/mean"], abs=1e-6
        )
    assert result.model_dir == tmp_path / "hf" and (result.model_dir / "config.json").is_file()
    assert not result.stopped and result.run_dir == tmp_path
    assert trainer.cfg.data.train_files[0].startswith(str(tmp_path / "data" / "train-"))


def stop_once(marker: Path, pid: int):
    """A reward function that sends the driver a Ctrl-C the first time it runs."""

    def reward(completions, **kwargs):
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            pass
        else:
            os.kill(pid, signal.SIGINT)
        return [0.0] * len(completions)

    return reward


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_a_first_ctrl_c_ends_train_with_a_checkpoint(ray_local, tmp_path):
    trainer = GRPOTrainer(
        reward_funcs=stop_once(tmp_path / "sent", os.getpid()),
        train_dataset=larger_rows(64),
        output_dir=tmp_path / "run",
        max_steps=6,
        print_fn=lambda line: None,
        **TRL_SETTINGS,
        **SMALL,
    )
    result = trainer.train()
    assert result.stopped and result.model_dir is None and len(result.history) < 6
    assert (tmp_path / "sent").is_file()
    assert any((tmp_path / "run" / "checkpoints").glob("global_step_*"))


def test_a_callable_that_does_not_pickle_is_refused_naming_it(tmp_path):
    lock = threading.Lock()

    def holds_a_lock(completions, **kwargs):
        with lock:
            return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"holds_a_lock cannot be sent .* not pickle"):
        GRPOTrainer(reward_funcs=[exact, holds_a_lock], output_dir=tmp_path)


@pytest.mark.parametrize(
    ("keywords", "error", "expected"),
    [
        ({"learning_rat": 1e-3}, TypeError, "did you mean 'learning_rate'"),
        ({"total_training_steps": 3}, TypeError, "did you mean 'trainer.total_training_steps'"),
        ({"per_device_train_batch_size": 8}, TypeError, "'data.train_batch_size'"),
        ({"trainer.total_training_step": 3}, ConfigError, "'trainer.total_training_steps'"),
    ],
)
def test_an_unknown_keyword_is_refused_naming_the_nearest_key(tmp_path, keywords, error, expected):
    with pytest.raises(error, match=expected):
        GRPOTrainer(output_dir=tmp_path, **keywords)


def test_trl_names_and_dotted_keys_set_the_config_over_a_base_config(tmp_path):
    base = load_config("demo")  # a config object as the base, as well as a built-in name
    cfg = GRPOTrainer(
        config=base,
        output_dir=tmp_path,
        learning_rate=3e-6,
        num_generations=6,
        beta=0.04,
        num_train_epochs=2,
        **{
            "data.train_batch_size": 32,
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 8,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,
        },
    ).cfg
    arr = cfg.actor_rollout_ref
    assert (arr.actor.optim.lr, arr.rollout.n, arr.actor.kl_loss_coef) == (3e-6, 6, 0.04)
    assert arr.actor.use_kl_loss and cfg.trainer.total_epochs == 2
    assert cfg.trainer.total_training_steps is None  # epochs decide, as TRL's max_steps=-1
    assert cfg.trainer.output_dir == str(tmp_path) and cfg.data.train_batch_size == 32
    assert arr.actor.ppo_micro_batch_size_per_gpu == 32
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 8
    assert cfg.data.synthetic_task == "larger" == base.data.synthetic_task
    with pytest.raises(TypeError, match="'actor_rollout_ref.rollout.n' is set twice"):
        GRPOTrainer(num_generations=2, **{"actor_rollout_ref.rollout.n": 4})


def test_data_files_in_trl_columns_are_converted_and_rayrl_ones_read_as_they_are(tmp_path):
    trl = tmp_path / "trl.jsonl"
    trl.write_text('{"prompt": "Which is larger, 3 or 7?", "answer": "7"}\n')
    converted = GRPOTrainer(train_dataset=trl, output_dir=tmp_path).cfg.data.train_files
    assert converted[0].startswith(str(tmp_path / "data" / "train-"))
    assert read_rows(converted[0])[0]["extra_info"]["answer"] == "7"
    rayrl = GRPOTrainer(train_dataset=converted, eval_dataset=converted, output_dir=tmp_path).cfg
    assert rayrl.data.train_files == converted == rayrl.data.val_files


QUESTION = "Which is larger, 3 or 7?"
CHAT = [{"role": "user", "content": QUESTION}]


@pytest.mark.parametrize("prompt", [QUESTION, CHAT])
def test_a_dataframe_and_a_list_give_the_same_data_files(tmp_path, prompt):
    pd = pytest.importorskip("pandas")
    # the second row lacks a string column (pandas makes an int column with a gap float)
    rows = [{"prompt": prompt, "answer": "7", "level": 1}, {"prompt": prompt, "level": 2}]
    listed = GRPOTrainer(train_dataset=rows, output_dir=tmp_path).cfg.data.train_files
    framed = GRPOTrainer(train_dataset=pd.DataFrame(rows), output_dir=tmp_path)
    assert framed.cfg.data.train_files == listed and len(listed) == 1
    first, second = read_rows(listed[0])
    assert first["prompt"] == CHAT and first["reward_model"]["ground_truth"] == ""
    assert first["extra_info"] == {"answer": "7", "level": 1, "prompt": prompt}
    assert second["extra_info"]["answer"] is None  # a DataFrame's NaN, a list's missing key


CALLS: list[dict] = []


def recorded(prompts, completions, **columns):
    """Records what it is given (in this process: the test resolves the spec here)."""
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [0.5]


def rayrl_style(data_source, solution_str, ground_truth, extra_info):
    """rayrl's own signature: a dict with a score and an extra metric."""
    return {"score": float(solution_str == ground_truth), "acc": 1.0}


@pytest.mark.parametrize("prompt", [QUESTION, CHAT])
def test_reward_functions_get_the_datasets_other_columns(tmp_path, prompt):
    rows = [{"prompt": prompt, "answer": "7", "level": 1, "ground_truth": "7"}]
    trainer = GRPOTrainer(
        reward_funcs=[recorded, rayrl_style],
        reward_weights=[2.0, 1.0],
        train_dataset=rows,
        output_dir=tmp_path,
    )
    # as the reward workers load them: the config's pickled spec, resolved
    spec = spec_from_config(None, pickled=trainer.cfg.custom_reward_function.pickled)
    [row] = read_rows(trainer.cfg.data.train_files[0])
    item = {
        "data_source": row["data_source"],
        "solution_str": "7",
        "ground_truth": row["reward_model"]["ground_truth"],
        "extra_info": row["extra_info"],
    }
    CALLS.clear()
    expected = {"score": 2.0, "recorded": 0.5, "rayrl_style": 1.0, "acc": 1.0}
    assert resolve_function(spec)(**item) == expected
    batched = resolve_function(spec, batched=True)
    assert batched(*([value] for value in item.values())) == [expected]
    completion = [{"role": "assistant", "content": "7"}] if prompt == CHAT else "7"
    given = {"prompts": [prompt], "completions": [completion]}
    columns = {"answer": ["7"], "level": [1], "ground_truth": ["7"]}
    assert [{**given, **columns}] * 2 == CALLS  # once per call above


def test_a_reward_function_asking_for_a_column_the_data_lacks_is_refused(tmp_path):
    with pytest.raises(RewardFunctionError, match=r"exact needs \['answer'\].*given"):
        GRPOTrainer(reward_funcs=exact, train_dataset=[{"prompt": "hi"}], output_dir=tmp_path)


def test_a_reward_error_names_the_functions(tmp_path):
    from rayrl.workers.reward import error_policy

    trainer = GRPOTrainer(reward_funcs=[recorded, rayrl_style], output_dir=tmp_path)
    _, _, reward, _ = error_policy(trainer.cfg)
    assert "test_api.recorded + test_api.rayrl_style" in reward


def test_a_relative_output_dir_is_the_drivers_whatever_the_workers_directory(
    ray_local, tmp_path, monkeypatch
):
    # Ray's workers keep the directory Ray started in (a cluster joined through
    # resources.address: wherever `ray start` ran); the run's files must land in the
    # driver's `rel`, the workers' checkpoint shards with the driver's own parts.
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(
        reward_funcs=exact,
        train_dataset=larger_rows(16),
        output_dir="rel",
        max_steps=1,
        save_steps=1,
        print_fn=lambda line: None,
        **TRL_SETTINGS,
        **SMALL,
    )
    result = trainer.train()
    step = tmp_path / "rel" / "checkpoints" / "global_step_1"
    written = sorted(p.relative_to(step).parts[0] for p in step.rglob("*") if p.is_file())
    assert result.run_dir == tmp_path / "rel" and "actor" in written, written
    assert (tmp_path / "rel" / "hf" / "config.json").is_file()


def test_beta_zero_and_max_steps_beside_epochs_keep_trls_meaning(tmp_path):
    """beta=0 leaves the KL loss off (the base config has it on); max_steps given with
    num_train_epochs decides the steps, as in TRL."""
    cfg = GRPOTrainer(output_dir=tmp_path, beta=0.0, max_steps=5, num_train_epochs=2).cfg
    actor = cfg.actor_rollout_ref.actor
    assert load_config("grpo").actor_rollout_ref.actor.use_kl_loss  # on in the base
    assert not actor.use_kl_loss and actor.kl_loss_coef == 0.0
    assert cfg.trainer.total_training_steps == 5 and cfg.trainer.total_epochs == 2


def test_a_column_only_the_train_dataset_has_is_refused(tmp_path):
    """Reward functions score the eval rows too: a column the eval dataset lacks is
    refused in the constructor, naming it."""
    with pytest.raises(RewardFunctionError, match=r"exact needs \['answer'\]"):
        GRPOTrainer(
            reward_funcs=exact,
            train_dataset=[{"prompt": QUESTION, "answer": "7"}],
            eval_dataset=[{"prompt": QUESTION}],
            output_dir=tmp_path,
        )


def test_the_prompt_is_passed_as_prompts_not_as_a_column(tmp_path):
    """A batch-style function asking for `prompt` (TRL passes `prompts`) is refused in
    the constructor: the dataset's prompt is not one of the columns it is given."""

    def wants_prompt(prompt, completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"wants_prompt needs \['prompt'\]"):
        GRPOTrainer(
            reward_funcs=wants_prompt, train_dataset=[{"prompt": QUESTION}], output_dir=tmp_path
        )


def test_reward_functions_pickle_without_the_cloudpickle_package():
    # cloudpickle is no dependency of rayrl's (Ray carries its own copy): a machine
    # without the package pickles and loads a closure all the same.
    code = """
import sys
sys.modules["cloudpickle"] = None  # import cloudpickle fails, as where it is absent
from rayrl.rewards.callables import RewardFuncs, pickle_funcs
from rayrl.rewards.loader import PickledFunction
bonus = 2.0
funcs = RewardFuncs([lambda completions, **kw: [bonus * len(c) for c in completions]])
fn = PickledFunction(pickle_funcs(funcs)).load()
print(fn("src", "abc", ""))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "6.0", done.stderr[-800:]

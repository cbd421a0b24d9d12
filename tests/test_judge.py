"""The LLM judge: a tiny judge model in the HF engine behind its OpenAI-compatible server
on 127.0.0.1, the built-in judge's verdict parsers and error policy, and verl's
generative reward model contract through `rayrl train`."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from conftest import start_local_ray, train_one_step
from rayrl.config import load_config
from rayrl.config.errors import ConfigError
from rayrl.rewards.budget import ErrorBudget, RewardErrorRateError
from rayrl.rewards.judge import LLMJudge, genrm_kwargs, render_template
from rayrl.rewards.verdicts import VerdictError, make_parser
from rayrl.workers.judge import JudgeServer, check_judge

TEMPLATE = "Question: {question}\nAnswer: {response}\nTruth: {ground_truth}\nScore:"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("judge") / "m", layers=1, seed=3)


def _config(judge_dir, *overrides):
    return load_config(
        "grpo",
        [
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={judge_dir}",
            f"reward.judge.template={json.dumps(TEMPLATE)}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def judge(judge_dir):
    server = JudgeServer(_config(judge_dir, "reward.reward_model.rollout.prompt_length=64"), "cpu")
    yield server
    server.close()


def _post(address: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{address}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def test_server_answers_openai_chat_and_completions(judge):
    chat = {"model": "j", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 6}
    reply = _post(judge.address, "/v1/chat/completions", {**chat, "temperature": 0})
    [choice] = reply["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= reply["usage"]["completion_tokens"] <= 6
    # the chat template's rendering, not the raw text, is the prompt
    rendered = judge.tokenizer.apply_chat_template(
        chat["messages"], add_generation_prompt=True, tokenize=False
    )
    assert reply["usage"]["prompt_tokens"] == len(judge.tokenizer(rendered)["input_ids"])
    # seeded: the same request draws the same verdict, n samples draw distinct ones
    again = _post(judge.address, "/v1/chat/completions", {**chat, "temperature": 0})
    assert again["choices"] == reply["choices"]
    many = _post(judge.address, "/v1/completions", {"prompt": "hello", "max_tokens": 8, "n": 3})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in many["choices"]}) > 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(judge.address, "/v1/completions", {"prompt": "word " * 200, "max_tokens": 4})
    assert refused.value.code == 400
    assert "over the server's 64" in json.loads(refused.value.read())["error"]["message"]


def test_concurrent_requests_share_engine_steps(judge):
    before = judge.stats()
    replies: list[dict] = []

    def ask(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 6}
        replies.append(_post(judge.address, "/v1/chat/completions", body))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = judge.stats()
    tokens = after["completion_tokens"] - before["completion_tokens"]
    steps = after["steps"] - before["steps"]
    # a burst of connections at once: none refused (the listen backlog holds them)
    assert len(replies) == 48 and after["requests"] - before["requests"] == 48
    # one by one, each token would be a step of its own; batched, the steps are shared
    assert steps < tokens / 2, (steps, tokens)
    assert (after["stepped"] - before["stepped"]) / steps > 2


def test_verdict_parsers_read_numbers_and_labels():
    number = make_parser("number", score_range=[0, 10])
    assert number("I think 3, final score: 7") == 7.0
    with pytest.raises(VerdictError, match="no number"):
        number("looks right to me")
    with pytest.raises(VerdictError, match="outside"):
        number("score 11")
    label = make_parser("label", labels={"correct": 1, "incorrect": 0})
    assert label("Verdict: Incorrect") == 0.0 and label("it is CORRECT.") == 1.0
    with pytest.raises(VerdictError, match="none of the labels"):
        label("correctly done")  # a whole word only
    with pytest.raises(ValueError, match="reward.judge.labels"):
        make_parser("label")


def test_builtin_judge_checks_its_settings(judge_dir):
    with pytest.raises(ConfigError, match="has no \\{response\\}"):
        check_judge(_config(judge_dir, "reward.judge.template='rate it'"))
    with pytest.raises(ConfigError, match="verdict parser 'numbr'"):
        check_judge(_config(judge_dir, "reward.judge.parser=numbr"))
    with pytest.raises(ConfigError, match="needs reward_model.nnodes >= 1"):
        _config(judge_dir, "reward.reward_model.enable_resource_pool=true")  # verl's nnodes 0


def test_unparseable_verdicts_are_reward_errors_under_the_budget(judge):
    items = [
        {
            "data_source": "d",
            "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
            "solution_str": str(i + 1),
            "ground_truth": str(i + 1),
        }
        for i in range(12)
    ]
    assert render_template(TEMPLATE, items[0]).startswith("Question: What is 0+1?\nAnswer: 1\n")
    parser = make_parser("number")
    source = LLMJudge(judge.address, TEMPLATE, parser, max_tokens=8, temperature=1.0)
    results = source.score(items)
    # each result is what the parser makes of the verdict the server gives that prompt
    for item, result in zip(items, results, strict=True):
        body = {
            "model": "judge",
            "messages": [{"role": "user", "content": render_template(TEMPLATE, item)}],
            "max_tokens": 8,
            "temperature": 1.0,
        }
        verdict = _post(judge.address, "/v1/chat/completions", body)["choices"][0]
        try:
            expected = parser(verdict["message"]["content"])
        except VerdictError as exc:
            assert result.error == str(exc) and result.score == 0.0
            assert result.extra == {"judge/parse_failures": 1.0}
        else:
            assert result.ok and result.score == expected
    failed = sum(not r.ok for r in results)
    assert failed > 0, "the random judge must write some verdicts without a number"
    assert source.stats()["parse_failures"] == failed
    # the error policy: a budget under the failed share stops, naming the judge
    strict = ErrorBudget(source, failed / len(items) - 0.01, reward="the LLM judge")
    with pytest.raises(RewardErrorRateError, match=f"the LLM judge failed on {failed} of 12"):
        strict.score(items)
    ErrorBudget(source, failed / len(items)).score(items)  # at the rate: goes on


def test_genrm_kwargs_follow_the_signature():
    def named(data_source, solution_str, ground_truth, extra_info, reward_router_address):
        return 0

    def open_kwargs(data_source, solution_str, ground_truth, extra_info, **kwargs):
        return 0

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 0

    assert genrm_kwargs(named, "h:1", "tok") == {"reward_router_address": "h:1"}
    assert genrm_kwargs(open_kwargs, "h:1", "tok") == {
        "reward_router_address": "h:1",
        "reward_model_tokenizer": "tok",
    }
    assert genrm_kwargs(plain, "h:1", "tok") == {}


GENRM_FILE = '''
import aiohttp


async def compute_score(data_source, solution_str, ground_truth, extra_info,
                        reward_router_address, reward_model_tokenizer, **kwargs):
    """A verl-style generative reward: ask the judge, score by its answer's length."""
    prompt = f"Is {solution_str!r} the answer {ground_truth!r}? Say yes or no."
    body = {
        "model": "judge",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": 6,
    }
    url = f"http://{reward_router_address}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as reply:
            verdict = (await reply.json())["choices"][0]["message"]["content"]
    rendered = reward_model_tokenizer.apply_chat_template(body["messages"], tokenize=False)
    return {"score": len(verdict) / 100.0, "judged": 1.0, "rendered": float(bool(rendered))}
'''


def _train(out, judge_dir, *overrides: str) -> dict:
    """`rayrl train` for one GRPO step scored by the judge; the step's metrics."""
    judge = ["reward.reward_model.enable=true", f"reward.reward_model.model_path={judge_dir}"]
    return train_one_step(out, *judge, *overrides)


def test_rayrl_train_scores_with_a_verl_genrm_file(tmp_path, judge_dir):
    reward_file = tmp_path / "genrm.py"
    reward_file.write_text(GENRM_FILE)
    row = _train(tmp_path / "run", judge_dir, f"reward.custom_reward_function.path={reward_file}")
    assert row["reward/errors"] == 0 and row["reward/judged/mean"] == 1.0
    assert row["reward/rendered/mean"] == 1.0
    assert row["judge/tokens_per_s"] > 0 and row["judge/latency_s"] > 0


def test_rayrl_train_with_the_builtin_judge_on_its_own_pool(tmp_path, judge_dir):
    row = _train(
        tmp_path / "run",
        judge_dir,
        f"reward.judge.template={json.dumps(TEMPLATE)}",
        "reward.judge.max_tokens=6",
        "reward.judge.temperature=1.0",
        "reward.max_error_rate=1.0",  # a random judge: most verdicts have no number
        "reward.reward_model.enable_resource_pool=true",
        "reward.reward_model.nnodes=1",
        "reward.reward_model.n_gpus_per_node=1",
    )
    # each unreadable verdict is a reward error, and counted as a parse failure
    assert row["reward/errors"] == round(8 * row["judge/parse_failures"])
    assert row["judge/tokens_per_s"] > 0 and row["judge/latency_s"] > 0
    assert row["judge/batch"] > 1  # the scoring's 8 verdicts shared engine steps


@pytest.mark.slow
def test_a_judge_replica_killed_between_steps_is_replaced_and_found(tmp_path, judge_dir):
    """The judge's replica on its own pool is SIGKILLed after step 1: step 2's scoring
    fails to reach it, the step's recovery replaces it (another process, another port),
    and the reward worker finds the new address in the run's KV store: the run ends
    with every sample scored."""
    import os
    import signal

    from rayrl.trainer.ppo import PPOTrainer
    from rayrl.trainer.run import Run

    start_local_ray()
    cfg = _config(
        judge_dir,
        "trainer.total_training_steps=3",
        "trainer.device=cpu",
        "data.train_batch_size=4",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "reward.judge.max_tokens=4",
        "reward.max_error_rate=1.0",  # a random judge's verdicts mostly fail to parse
        "reward.reward_model.enable_resource_pool=true",
        "reward.reward_model.nnodes=1",
        "reward.reward_model.n_gpus_per_node=1",
        f"trainer.output_dir={tmp_path / 'run'}",
    )
    printed: list[str] = []
    run = Run(PPOTrainer(cfg, print_fn=printed.append))
    killed: list[str] = []

    def on_step(step: int, _metrics: dict) -> None:
        if step == 1:
            [judges] = [g for g in run.trainer.roles.groups if g.role == "judge"]
            killed.append(judges.call("address")[0])
            os.kill(int(judges.infos[0]["pid"]), signal.SIGKILL)

    try:
        run.setup()
        history = run.fit(on_step=on_step)
        [judges] = [g for g in run.trainer.roles.groups if g.role == "judge"]
        now = judges.call("address")[0]
    finally:
        run.shutdown()
    assert len(history) == 3 and run.replay.recoveries, printed
    assert now != killed[0]  # a new replica, found by the reward worker
    assert all(row["judge/tokens_per_s"] > 0 for row in history)

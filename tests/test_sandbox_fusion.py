"""SandboxFusion against a real local stand-in server (`sandbox_fusion_server`): the
client's run_code protocol, retries and bounds; the reward of verl's code data sources
(pass, fail, compile error, timeout, server down, under the reward's error budget); and
verl's SandboxFusion tool in a multi-turn episode."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.envs import Episode, build_tool, load_tool_config, make_environment, make_parser
from rayrl.envs.builtin.python_code import PythonInterpreter
from rayrl.envs.builtin.sandbox_fusion import SandboxFusionTool
from rayrl.envs.toolbox import Toolbox
from rayrl.rewards.budget import ErrorBudget, RewardErrorRateError
from rayrl.rewards.code_tests import case_passed, extract_code, parse_test_cases
from rayrl.sandbox_fusion import SandboxFusion, SandboxFusionError
from rayrl.workers.reward import error_policy, make_source
from sandbox_fusion_server import StandInSandbox, closed_port_url

ECHO_SUM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
CPP_BROKEN = "int main() { return missing_symbol; }\n"


@pytest.fixture(scope="module")
def server():
    with StandInSandbox() as running:
        yield running


# ----------------------------------------------------------------------- the client


def test_run_code_sends_verls_request_and_reads_the_reply(server):
    client = SandboxFusion(server.url, memory_limit_mb=300)
    run = client.run_code(ECHO_SUM, stdin="2 3 4", run_timeout=5)
    assert (run.status, run.outcome, run.stdout) == ("Success", "success", "9\n")
    sent = server.requests[-1]
    assert sent["language"] == "python" and sent["stdin"] == "2 3 4"
    assert (sent["run_timeout"], sent["compile_timeout"], sent["memory_limit_MB"]) == (5, 10.0, 300)
    assert sent["files"] == {} and sent["fetch_files"] == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="the stand-in compiles C++ with g++")
def test_a_compile_error_and_a_timeout_are_told_apart(server):
    client = SandboxFusion(server.url)
    broken = client.run_code(CPP_BROKEN, language="cpp")
    assert (broken.status, broken.outcome, broken.run) == ("Failed", "compile_error", None)
    assert (
        broken.summary().startswith("Compilation failed:") and "missing_symbol" in broken.summary()
    )
    fine = client.run_code('#include <cstdio>\nint main() { puts("ok"); }', language="cpp")
    assert fine.outcome == "success" and fine.stdout == "ok\n"
    looped = client.run_code("while True: pass", run_timeout=0.5)
    assert (looped.status, looped.outcome) == ("Failed", "timeout")
    assert "time limit" in looped.summary()
    raised = client.run_code("print('before')\nraise ValueError('bad')")
    assert raised.outcome == "runtime_error"
    assert "before" in raised.summary() and "ValueError: bad" in raised.summary()


def test_the_memory_limit_reaches_the_run(server):
    grab = "x = b'x' * (200 << 20)\nprint('allocated')"
    assert SandboxFusion(server.url, memory_limit_mb=64).run_code(grab).outcome == "runtime_error"
    assert SandboxFusion(server.url, memory_limit_mb=1024).run_code(grab).stdout == "allocated\n"


def test_transient_failures_are_retried_and_an_outage_names_the_url():
    with StandInSandbox(fail_first=2) as busy:
        client = SandboxFusion(busy.url, backoff_s=0.01)
        assert client.run_code("print(1)").stdout == "1\n"
        assert (client.requests, client.retried) == (3, 2)
    url = closed_port_url()
    client = SandboxFusion(url, retries=2, backoff_s=0.01)
    with pytest.raises(SandboxFusionError, match="failed after 3 attempt") as err:
        client.run_code("print(1)")
    assert url in str(err.value) and "reward.sandbox_fusion.url" in str(err.value)


def test_a_refused_request_is_not_retried(server):
    client = SandboxFusion(server.url, backoff_s=0.01)
    with pytest.raises(SandboxFusionError, match="HTTP 422") as err:
        client.run_code("x", language="cobol")
    assert "unsupported language 'cobol'" in str(err.value) and client.requests == 1


def test_max_concurrent_bounds_the_requests_at_once():
    with StandInSandbox(delay_s=0.3) as slow:
        client = SandboxFusion(slow.url, max_concurrent=2)
        threads = [threading.Thread(target=client.run_code, args=("pass",)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert slow.peak == 2 and len(slow.requests) == 6


def test_a_url_that_is_not_http_is_refused_at_load():
    with pytest.raises(ConfigError, match="reward.sandbox_fusion.url='sandbox:8080'"):
        load_config("grpo", ["reward.sandbox_fusion.url=sandbox:8080"])


# ----------------------------------------------------------------------- the reward


def test_verls_code_block_and_test_case_rules():
    assert extract_code("text\n```python\na = 1\n```\nmore ```python\nb = 2\n```") == "\nb = 2\n"
    assert extract_code("```py\nc = 3\n```") == "c = 3\n"
    assert extract_code("```\nd = 4\n```") == "\nd = 4\n"
    assert extract_code("no code here") is None
    cases = parse_test_cases(json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}))
    assert (cases.inputs, cases.outputs, cases.fn_name) == (["1 2\n"], ["3\n"], None)
    asserts = parse_test_cases({"assert_case": ["assert f(1) == 2"]})
    assert asserts.inputs == [""] and asserts.outputs == [None]
    for bad, says in [
        ("not json", "not JSON"),
        ({"inputs": ["1"]}, "need 'inputs' and 'outputs'"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs and 0 outputs"),
        ({"inputs": [], "outputs": []}, "at least one"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_test_cases(bad)
    assert case_passed("3\n\n", "3\n") and not case_passed("3", "4")
    assert case_passed("[1, 2]\n", [1, 2]) and case_passed("7\n", [7])  # APPS's layout


def reward_config(url: str, *overrides: str):
    return load_config(
        "grpo",
        [
            f"reward.sandbox_fusion.url={url}",
            "reward.sandbox_fusion.max_concurrent=3",
            "reward.sandbox_fusion.memory_limit_mb=256",
            "reward.num_workers=1",
            *overrides,
        ],
    )


def code_item(answer: str, ground_truth, source: str = "codecontests") -> dict:
    return {
        "data_source": source,
        "solution_str": f"Here it is:\n```python\n{answer}```",
        "ground_truth": ground_truth,
        "extra_info": None,
    }


SUM_CASES = json.dumps({"inputs": ["1 2", "3 4", "10 -1", "0 0"], "outputs": ["3", "7", "9", "0"]})


def test_code_answers_score_the_fraction_of_cases_they_pass(server):
    cfg = reward_config(server.url)
    source = make_source(cfg)
    source.case_timeout_s = 3.0  # verl's 10 s, shortened for the endless loop below
    try:
        before = len(server.requests)
        results = source.score(
            [
                code_item(ECHO_SUM, SUM_CASES),  # all 4 pass
                code_item("print(3)\n", SUM_CASES, "apps"),  # only the first
                code_item("print(int(input().split()[0]) +\n", SUM_CASES, "taco"),  # syntax
                code_item("while True: pass\n", {"inputs": ["1"], "outputs": ["1"]}),
                {**code_item("", SUM_CASES), "solution_str": "no code at all"},
                {
                    "data_source": "openai/gsm8k",
                    "solution_str": "#### 72",
                    "ground_truth": "72",
                    "extra_info": None,
                },
            ]
        )
        assert [r.score for r in results] == [1.0, 0.25, 0.0, 0.0, 0.0, 1.0]
        assert all(r.ok for r in results)
        sent = server.requests[before:]
        assert len(sent) == 4 + 4 + 4 + 1  # the sample without code ran nothing
        assert {r["memory_limit_MB"] for r in sent} == {256}
        assert {r["run_timeout"] for r in sent} == {3.0}
        assert 2 <= server.peak <= 3  # reward.sandbox_fusion.max_concurrent
    finally:
        source.close()


def test_function_and_assert_cases(server):
    source = make_source(reward_config(server.url))
    try:
        fn = {"fn_name": "add", "inputs": ["1\n2", [5, 6]], "outputs": ["3", [11]]}
        method = {**fn, "fn_name": "twice"}
        solution = "class Solution:\n    def twice(self, a, b):\n        return [a, b] * 2\n"
        method["outputs"] = ["[1, 2, 1, 2]", "[5, 6, 5, 6]"]
        asserts = {"assert_case": ["assert add(1, 2) == 3", "assert add(1, 1) == 3"]}
        results = source.score(
            [
                code_item("def add(a, b):\n    return a + b\n", fn),
                code_item(solution, method),
                code_item("def add(a, b):\n    return a + b\n", asserts),
            ]
        )
        assert [r.score for r in results] == [1.0, 1.0, 0.5]
    finally:
        source.close()


def test_a_server_that_is_down_fails_the_code_samples_under_the_error_budget():
    url = closed_port_url()
    cfg = reward_config(url, "reward.max_error_rate=0.5")
    source = make_source(cfg)
    source.client.backoff_s = 0.05  # the client's retries, without their 1 + 2 + 4 s waits
    budget = ErrorBudget(source, *error_policy(cfg))
    items = [code_item(ECHO_SUM, SUM_CASES) for _ in range(3)]
    gsm8k = {"data_source": "openai/gsm8k", "solution_str": "#### 1", "ground_truth": "1"}
    try:
        with pytest.raises(RewardErrorRateError) as err:
            budget.score([*items, {**gsm8k, "extra_info": None}])
        # the 3 cases started at once try 4 times each; the other 9 fail without a try
        assert source.client.requests == 3 * 4
    finally:
        budget.close()
    said = str(err.value)
    assert "failed on 3 of 4 samples" in said and f"SandboxFusion server {url}" in said
    assert "failed after 4 attempt(s)" in said and "is up and reachable" in said


def test_bad_test_cases_are_an_error_and_code_sources_need_a_url(server):
    source = make_source(reward_config(server.url))
    try:
        (bad,) = source.score([code_item(ECHO_SUM, {"inputs": ["1"]})])
    finally:
        source.close()
    assert not bad.ok and "need 'inputs' and 'outputs'" in bad.error
    plain = make_source(load_config("grpo", ["reward.num_workers=1"]))
    try:
        (refused,) = plain.score([code_item(ECHO_SUM, SUM_CASES)])
    finally:
        plain.close()
    assert not refused.ok and "set reward.sandbox_fusion.url" in refused.error


def test_the_url_with_a_function_of_ones_own_warns_as_verl_ignores_it(tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n"
    )
    said = []
    cfg = load_config(
        "grpo",
        [
            "reward.sandbox_fusion.url=http://127.0.0.1:1/run_code",
            f"custom_reward_function.path={fn}",
        ],
        warn=said.append,
    )
    assert any(
        "reward.sandbox_fusion.url=http://127.0.0.1:1/run_code has no effect" in s for s in said
    )
    source = make_source(cfg)
    try:
        assert type(source).__name__ == "RewardPool"
    finally:
        source.close()


# ------------------------------------------------------------------------- the tool


def verl_tool_yaml(tmp_path, config: str):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        f"    config: {config}\n"
        "    tool_schema: {type: function, function: {name: code_interpreter, description: "
        "Run code., parameters: {type: object, properties: {code: {type: string}}, "
        "required: [code]}}}\n"
    )
    return load_tool_config(path)


def test_verls_tool_with_a_url_runs_on_the_server_in_an_episode(server, tmp_path):
    (entry,) = verl_tool_yaml(
        tmp_path,
        f"{{sandbox_fusion_url: '{server.url}', default_timeout: 3, memory_limit_mb: 128, "
        "rate_limit: 4, type: native}",
    )
    tool = build_tool(entry)
    assert isinstance(tool, SandboxFusionTool) and tool.name == "code_interpreter"
    env = make_environment("tool_agent", toolbox=Toolbox.of([tool]), parser=make_parser("hermes"))
    env.reset(Episode("u/0", [{"role": "user", "content": "what is 6*7?"}], {}, {}))
    before = len(server.requests)
    call = {"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}
    step = env.step([], "<tool_call>" + json.dumps(call) + "</tool_call>")
    assert step.observation == [{"role": "tool", "name": "code_interpreter", "content": "42\n"}]
    loop = {"name": "code_interpreter", "arguments": {"code": "while True: pass"}}
    step = env.step([], "<tool_call>" + json.dumps(loop) + "</tool_call>")
    assert "killed at the time limit" in step.observation[0]["content"]
    assert env.step([], "The answer is 42.").done
    sent = server.requests[before:]
    assert [(r["run_timeout"], r["memory_limit_MB"]) for r in sent] == [(3.0, 128)] * 2
    assert [e.status for e in env.events] == ["ok", "ok"]


def test_verls_tool_without_a_url_stays_local_and_an_outage_is_a_failed_call(tmp_path):
    (local,) = verl_tool_yaml(tmp_path, "{default_timeout: 3, type: native}")
    assert isinstance(build_tool(local), PythonInterpreter)
    (down,) = verl_tool_yaml(tmp_path, f"{{sandbox_fusion_url: '{closed_port_url()}'}}")
    tool = build_tool(down)
    tool.client.backoff_s = 0.01
    session = Toolbox.of([tool]).session()
    ((_, text),) = session.run(
        make_parser("hermes")
        .parse(
            '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
        )
        .calls
    )
    assert "failed after 4 attempt(s)" in text and session.events[0].status == "error"

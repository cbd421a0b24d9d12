"""rayrl.envs without a model: tool-call parsing, argument checks, the concurrent runner
(tools that hang, raise or return garbage), tool sessions and environments, the
built-in tools, and loading tools from user files, dotted paths and verl's tool YAML."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

from rayrl.config import load_config
from rayrl.envs import (
    ENVIRONMENTS,
    TOOLS,
    Episode,
    FunctionTool,
    HermesParser,
    LoadError,
    StepResult,
    Tool,
    Toolbox,
    ToolEnvironment,
    ToolRunner,
    build_tool,
    build_tools,
    check_arguments,
    episode_fields,
    load_object,
    load_tool_config,
    make_environment,
    make_parser,
)
from rayrl.envs.builtin.calculator import CalculatorError, evaluate
from rayrl.envs.interaction import call_interaction
from rayrl.envs.registry import TOOL_PARSERS
from rayrl.registry import UnknownNameError


def call_text(name: str, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ---------------------------------------------------------------- parsing
def test_verls_qwen_formats_are_hermes():
    """verl's SGLang-era `multi_turn.format=qwen` (SGLang's qwen25 parser) is the hermes
    format: the same parser, the same calls."""
    text = "Sure. " + call_text("calculator", {"expression": "1+2"})
    want = make_parser("hermes").parse(text)
    for name in ("qwen", "qwen25"):
        parser = make_parser(name)
        assert isinstance(parser, HermesParser)
        assert parser.parse(text) == want
    load_config("grpo", [f"actor_rollout_ref.rollout.multi_turn.format={name}"])


def test_gpt_oss_parses_harmony_calls_and_final_answers():
    """verl's `gpt-oss` format: calls are commentary messages to=functions.NAME ending at
    <|call|>; reasoning (analysis) is dropped, even when it mentions a call; the content
    is the final channel's text; bad JSON arguments are a malformed call."""
    parser = make_parser("gpt-oss")
    assert parser.keeps_special_tokens  # harmony's markers are special tokens
    reasoning = "<|channel|>analysis<|message|>try to=functions.fake<|message|>{}<|call|><|end|>"
    call = (
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        '<|message|>{"expression": "2+3"}<|call|>'
    )
    parsed = parser.parse(reasoning + call)
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("calculator", {"expression": "2+3"}, None)
    ]
    assert parsed.content == ""
    first = parser.parse('<|channel|>commentary to=functions.search<|message|>{"q": 1}<|call|>')
    assert first.calls[0].name == "search" and first.calls[0].arguments == {"q": 1}
    answer = "<|start|>assistant<|channel|>final<|message|>The answer is 5.<|return|>"
    done = parser.parse("<|channel|>analysis<|message|>easy<|end|>" + answer)
    assert done.calls == [] and done.content == "The answer is 5."
    bad = parser.parse("<|channel|>commentary to=functions.calculator<|message|>{oops<|call|>")
    assert bad.calls[0].name == "calculator" and "not JSON" in bad.calls[0].error
    load_config("grpo", ["actor_rollout_ref.rollout.multi_turn.format=gpt-oss"])


def test_hermes_parses_calls_and_reports_malformed_ones():
    parser = make_parser("hermes")
    text = (
        "Let me compute. "
        + call_text("calculator", {"expression": "1+2"})
        + '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"cats\\"}"}</tool_call>'
        + "<tool_call>{not json}</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'
        + "<tool_call>unclosed"
    )
    parsed = parser.parse(text)
    assert parsed.content == "Let me compute."
    calls = parsed.calls
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}, True),
        ("search", {"query": "cats"}, True),
    ]
    assert "not valid JSON" in calls[2].error
    assert 'no "name"' in calls[3].error
    assert calls[4].name == "x" and "JSON object" in calls[4].error
    assert "not closed" in calls[5].error
    assert parser.parse("no calls here").calls == []
    assert HermesParser(stop_at_call_end=True).stop == ("</tool_call>",)
    with pytest.raises(UnknownNameError, match="hermes"):
        make_parser("hermess")
    assert "hermes" in TOOL_PARSERS


def test_arguments_are_checked_against_the_schema():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "mode": {"enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["n"],
    }
    assert check_arguments({"n": 3, "mode": "a", "xs": [1, 2.5]}, schema) is None
    assert "missing required" in check_arguments({}, schema)
    assert "must be integer" in check_arguments({"n": "3"}, schema)
    assert "must be integer" in check_arguments({"n": True}, schema)
    assert "must be one of" in check_arguments({"n": 1, "mode": "c"}, schema)
    assert "xs[1]" in check_arguments({"n": 1, "xs": [1, "x"]}, schema)
    assert "unknown argument" in check_arguments({"n": 1, "zz": 0}, schema)
    assert "JSON object" in check_arguments([1], schema)


# ---------------------------------------------------------------- runner
def test_runner_survives_tools_that_hang_raise_or_exit():
    runner = ToolRunner(max_concurrency=2, default_timeout_s=0.5)
    release = threading.Event()
    start = time.perf_counter()
    futures = [
        runner.submit(lambda: release.wait(30) and "late"),  # hangs past its timeout
        runner.submit(lambda: 1 / 0),
        runner.submit(lambda: sys.exit(3)),
        runner.submit(lambda: "fine", timeout_s=5),
        runner.submit(lambda: release.wait(30) and "late"),
    ]
    outcomes = [f.result(timeout=10) for f in futures]
    assert outcomes[0].timed_out and outcomes[4].timed_out
    assert isinstance(outcomes[1].error, ZeroDivisionError)
    assert isinstance(outcomes[2].error, SystemExit)
    assert outcomes[3].ok and outcomes[3].value == "fine"
    # Two slots, two hung calls: the timeouts handed the slots back, nothing starved.
    assert time.perf_counter() - start < 5
    assert runner.abandoned == 2
    release.set()


def test_runner_reuses_its_threads_and_keeps_the_concurrency_limit():
    runner = ToolRunner(max_concurrency=3, default_timeout_s=5)
    threads = {runner.call(threading.get_ident).value for _ in range(20)}
    assert len(threads) == 1  # one after another: one worker, no thread per call
    lock, now, peak = threading.Lock(), [0], [0]

    def busy():
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return threading.get_ident()

    outcomes = [f.result(timeout=10) for f in [runner.submit(busy) for _ in range(9)]]
    assert all(o.ok for o in outcomes) and peak[0] == 3
    assert len({o.value for o in outcomes}) == 3


def test_runner_lets_go_of_finished_calls_before_their_deadline():
    """A finished call's deadline stays queued until it comes round (an environment
    step's is minutes away); the call's future and result must not wait with it."""

    class Result:
        pass

    runner = ToolRunner(max_concurrency=2, default_timeout_s=600)
    gate = threading.Event()
    blocker = runner.submit(gate.wait)  # a call in flight: its deadline heads the queue
    outcome = runner.call(Result)
    assert outcome.ok
    result = weakref.ref(outcome.value)
    del outcome
    gc.collect()
    assert result() is None
    gate.set()
    assert blocker.result(timeout=10).ok
    still = runner.submit(lambda: time.sleep(0.3), timeout_s=0.05).result(timeout=10)
    assert still.timed_out  # the watchdog still expires calls that overrun


def slow_echo(text: str, delay: float = 0.0) -> str:
    """Echo the text after a delay."""
    time.sleep(delay)
    return text


class Boom(Tool):
    name = "boom"

    def execute(self, arguments, state):
        raise RuntimeError("tool exploded")


class Garbage(Tool):
    name = "garbage"

    def execute(self, arguments, state):
        return {"bytes": "\ud800 lone surrogate", "nested": [1, None]}


class Counter(Tool):
    """Per-episode state: counts its calls; the reward is the count."""

    name = "counter"
    created: list = []

    def create(self, create_kwargs):
        Counter.created.append(dict(create_kwargs))
        return {"n": create_kwargs.get("start", 0)}

    def execute(self, arguments, state):
        state["n"] += 1
        return str(state["n"])

    def reward(self, state):
        return float(state["n"])


def make_box(timeout: float = 0.5, parallel: int = 8) -> Toolbox:
    tools = [FunctionTool(slow_echo), Boom(), Garbage(), Counter(), TOOLS.get("calculator")()]
    return Toolbox.of(
        tools, runner=ToolRunner(default_timeout_s=timeout), max_parallel_calls=parallel
    )


def test_session_turns_every_failure_into_an_observation():
    box = make_box(parallel=6)
    session = box.session({"counter": {"create_kwargs": {"start": 10}}})
    calls = (
        HermesParser()
        .parse(
            call_text("slow_echo", {"text": "hi"})
            + call_text("slow_echo", {"text": "zz", "delay": 5})
            + call_text("boom", {})
            + call_text("nope", {})
            + call_text("slow_echo", {"text": "a", "txt": "typo"})
            + "<tool_call>{oops</tool_call>"
            + call_text("counter", {})
        )
        .calls
    )
    start = time.perf_counter()
    results = session.run(calls)
    texts = [t for _, t in results]
    assert time.perf_counter() - start < 3  # the 5 s call timed out at 0.5 s
    assert texts[0] == "hi"
    assert "did not finish within 0.5 s" in texts[1]
    assert "RuntimeError: tool exploded" in texts[2]
    assert "unknown tool 'nope'" in texts[3] and "calculator" in texts[3]
    assert "unknown argument(s) ['txt']" in texts[4]
    assert "not run" in texts[6]  # past max_parallel_calls=6
    statuses = [e.status for e in session.events]
    assert statuses == [
        "ok",
        "timeout",
        "error",
        "unknown_tool",
        "invalid_arguments",
        "malformed",
        "skipped",
    ]
    again = session.run(HermesParser().parse(call_text("counter", {}) * 2).calls)
    assert sorted(t for _, t in again) == ["11", "12"]  # one state, created once
    assert Counter.created == [{"start": 10}]
    assert session.close() == {"counter": 12.0}
    garbage = box.session().run(HermesParser().parse(call_text("garbage", {})).calls)
    assert "lone surrogate" in garbage[0][1] and json.loads(garbage[0][1])["nested"] == [1, None]


class Number(Tool):
    name = "number"

    def execute(self, arguments, state):
        return 42  # not text: shown as "42", counted as the tool's error


def test_a_tool_that_returns_no_text_is_counted_as_an_error_and_shown():
    tools = [Number(), Garbage(), Counter()]
    box = Toolbox.of(tools, runner=ToolRunner(default_timeout_s=5), max_parallel_calls=3)
    session = box.session()
    calls = call_text("number", {}) + call_text("garbage", {}) + call_text("counter", {})
    texts = [text for _, text in session.run(HermesParser().parse(calls).calls)]
    assert texts[0] == "42"  # the model still sees the text
    assert [e.status for e in session.events] == ["error", "ok", "ok"]  # JSON data and text pass
    assert "returned int, not text" in session.events[0].message


def test_tool_environment_steps_and_ends():
    env = make_environment("tool_agent", toolbox=make_box(), parser=make_parser("hermes"))
    assert isinstance(env, ToolEnvironment) and ENVIRONMENTS.canonical("tool_agent") == "tools"
    env.reset(Episode("u/0", [{"role": "user", "content": "q"}], {}, {}))
    step = env.step([], "thinking " + call_text("calculator", {"expression": "6*7"}))
    assert not step.done
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "42"}]
    assert step.assistant["tool_calls"][0]["function"]["name"] == "calculator"
    assert env.step([], "The answer is 42.").done
    assert [e.status for e in env.events] == ["ok"]
    single = make_environment("single_turn_agent")
    assert single.step([], "anything").done
    with pytest.raises(UnknownNameError, match="Did you mean 'tools'"):
        make_environment("toolz")
    assert StepResult("user text").messages() == [{"role": "user", "content": "user text"}]


def test_episode_fields_follow_verl_columns():
    row = {
        "agent_name": "tool_agent",
        "extra_info": {
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}}
        },
    }
    assert episode_fields(row) == ("tool_agent", row["extra_info"]["tools_kwargs"])
    assert episode_fields({"extra_info": None}) == (None, {})


# ---------------------------------------------------------------- built-ins
def test_calculator_is_arithmetic_only():
    assert evaluate("(3 + 4) * 12 / 7") == 12.0
    assert evaluate("2 ** 10 - sqrt(16)") == 1020.0
    for bad in ("__import__('os').system('true')", "().__class__", "9**9**9", "'a' * 3"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    calc = build_tool("calculator")
    assert calc.execute({"expression": "1/0"}, None).startswith("Error")
    assert calc.execute({"expression": "6*7"}, None) == "42"


def test_search_ranks_a_local_corpus(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "\n".join(
            json.dumps({"text": t})
            for t in [
                "Paris is the capital of France.",
                "Cats sleep a lot.",
                "Berlin is in Germany.",
            ]
        )
    )
    tool = build_tool({"name": "search", "config": {"corpus_path": str(corpus), "top_k": 2}})
    out = tool.execute({"query": "capital of France"}, tool.create({}))
    assert out.splitlines()[1] == "1. Paris is the capital of France."
    own = tool.create({"corpus": ["dogs bark", "birds sing"]})
    assert "birds sing" in tool.execute({"query_list": ["sing"]}, own)
    assert "No documents" in tool.execute({"query": "zebra"}, own)


def test_an_interactions_awaitable_answer_is_awaited_coroutine_or_not():
    """verl's interactions are async (a coroutine); any other awaitable is awaited too
    (`asyncio.run` took coroutines only: it refused a future-like answer)."""

    class Answer:
        def __await__(self):
            yield from ()
            return (True, "done", 1.0)

    async def answer():
        return (False, "more", None)

    assert call_interaction(lambda: Answer()) == (True, "done", 1.0)
    assert call_interaction(answer) == (False, "more", None)
    assert call_interaction(lambda x: x + 1, 1) == 2


def test_gsm8k_answer_tool_rewards_the_right_answer():
    tool = build_tool(
        {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"}}
    )
    state = tool.create({"ground_truth": "72"})
    assert "reward=0.0" in tool.execute({"answer": "71"}, state)
    assert "reward=1.0" in tool.execute({"answer": "#### 72"}, state)
    assert tool.reward(state) == 1.0


# ---------------------------------------------------------------- loading
USER_TOOLS = textwrap.dedent(
    '''
    import asyncio
    from rayrl.envs import Tool

    class Shout(Tool):
        name = "shout"
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        def execute(self, arguments, state):
            return arguments["text"].upper()

    def add(a: int, b: int = 1) -> int:
        """Add two integers.

        More text."""
        return a + b

    class VerlStyle:
        """Written against verl's BaseTool protocol (no verl import needed to run it)."""

        def __init__(self, config, tool_schema):
            self.config, self.tool_schema = config, tool_schema
            self.name = tool_schema.function.name
            self.log = []

        async def create(self, instance_id=None, **kwargs):
            self.log.append(("create", kwargs))
            return "inst-1", None

        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(0)
            return type("Resp", (), {"text": f"{instance_id}:{parameters['q']}"})(), 0.5, {}

        async def calc_reward(self, instance_id, **kwargs):
            return 2.0

        async def release(self, instance_id, **kwargs):
            self.log.append(("release", instance_id))
    '''
)


def test_tools_load_from_files_dotted_paths_and_verl_yaml(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text(USER_TOOLS)
    shout = build_tool(f"{module}:Shout")
    assert shout.execute({"text": "hey"}, None) == "HEY"
    add = build_tool((str(module), "add"))
    assert add.schema["function"]["description"] == "Add two integers."
    assert add.parameters["required"] == ["a"]
    assert add.parameters["properties"]["a"] == {"type": "integer"}
    assert load_object("rayrl.envs.builtin.calculator:Calculator") is TOOLS.get("calculator")
    assert isinstance(build_tool("rayrl.envs.builtin.calculator.Calculator"), Tool)

    config = tmp_path / "tools.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            tools:
              - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
                config: {{"type": "native"}}
                tool_schema:
                  type: "function"
                  function:
                    name: "code_interpreter"
                    description: "A tool for executing code."
                    parameters:
                      type: "object"
                      properties: {{code: {{type: "string", description: "The code."}}}}
                      required: ["code"]
              - class_name: "{module}:VerlStyle"
                config: {{type: native}}
                tool_schema:
                  type: function
                  function:
                    name: lookup
                    description: Look something up.
                    parameters: {{type: object, properties: {{q: {{type: string}}}}, required: [q]}}
            """
        )
    )
    code, verl_style = build_tools(load_tool_config(config))
    assert code.name == "code_interpreter" and type(code).__name__ == "PythonInterpreter"
    assert verl_style.name == "lookup" and verl_style.schema["function"]["description"]
    box = Toolbox.of([verl_style], runner=ToolRunner(default_timeout_s=5))
    session = box.session({"lookup": {"create_kwargs": {"k": 1}}})
    assert session.run(HermesParser().parse(call_text("lookup", {"q": "x"})).calls) == [
        ("lookup", "inst-1:x")
    ]
    assert session.close() == {"lookup": 2.0}
    assert verl_style.inner.log == [("create", {"create_kwargs": {"k": 1}}), ("release", "inst-1")]


def test_loading_errors_say_what_to_fix(tmp_path):
    with pytest.raises(UnknownNameError, match="Did you mean 'calculator'"):
        build_tool("calculater")
    with pytest.raises(LoadError, match="no such file"):
        build_tool(f"{tmp_path}/missing.py:X")
    (tmp_path / "t.py").write_text("class Shout: pass\n")
    with pytest.raises(LoadError, match="Did you mean 'Shout'"):
        build_tool(f"{tmp_path}/t.py:Shuot")
    with pytest.raises(LoadError, match="not a rayrl.envs.Tool"):
        build_tool(f"{tmp_path}/t.py:Shout")
    with pytest.raises(LoadError, match="rayrl runs native tools only"):
        build_tool({"class_name": "x.Y", "config": {"type": "mcp"}})
    with pytest.raises(LoadError, match="unique"):
        build_tools(["calculator", "calculator"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("toolz: []\n")
    with pytest.raises(LoadError, match="no 'tools:' list"):
        load_tool_config(bad)


def _tool_yaml(tmp_path, parameters: str):
    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n  - class_name: rayrl.envs.builtin.calculator.Calculator\n"
        "    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: calc, description: Math., "
        f"parameters: {parameters}}}}}\n"
    )
    return load_tool_config(config)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ("{type: objekt, properties: {}}", "parameters.type='objekt' is not a JSON Schema type"),
        ("{type: object, properties: [expression]}", "parameters.properties is list, not an"),
        (
            "{type: object, properties: {expression: {type: text}}}",
            "parameters.properties.expression.type='text' is not a JSON Schema type",
        ),
        (
            "{type: object, properties: {expression: {type: string}}, required: [expr]}",
            "parameters.required names ['expr'], which parameters.properties does not have",
        ),
        (
            "{type: object, properties: {n: {type: integer, minimum: low}}}",
            "parameters.properties.n.minimum: 'low' is not of type 'number'",
        ),
        ("[expression]", "parameters is list, not an object schema"),
    ],
)
def test_a_tool_schema_that_is_not_json_schema_is_refused_at_load(tmp_path, parameters, says):
    with pytest.raises(LoadError) as err:
        build_tools(_tool_yaml(tmp_path, parameters))
    assert str(err.value).startswith("tool 'calc': its tool_schema is not valid JSON Schema")
    assert says in str(err.value)
    good = "{type: object, properties: {expression: {type: string}}, required: [expression]}"
    assert build_tools(_tool_yaml(tmp_path, good))[0].name == "calc"


def test_envs_is_a_leaf():
    """Importing rayrl.envs pulls in no Ray, torch or rayrl engine code."""
    code = (
        "import sys, rayrl.envs; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'transformers') "
        "or m.startswith(('rayrl.train', 'rayrl.workers', 'rayrl.trainer', 'rayrl.cluster'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

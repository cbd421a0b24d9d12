"""A tiny model that uses tools, for the multi-turn rollout tests.

A random tiny model almost never writes a valid tool call, so `train_agent_model`
teaches one a dozen scripted episodes (`SCRIPTS`): a prompt, then assistant turns
that call tools in the hermes format, each followed by the tools' real responses in
the chat format the rollout appends (`TurnFormat`). It trains on the assistant
tokens only, until greedy decoding reproduces every scripted turn given its exact
context (teacher-forced argmax accuracy 1.0, and a low loss, so with a margin), and
saves the model directory. Each
script exercises one behaviour: a calculator call, two calls in one turn, a malformed
call, an unknown tool, a tool that hangs, one that raises, one that returns garbage,
a loop of calls (turn limits), a tool whose response is long (truncation), a
two-sample handshake (a tool that waits until another sample calls its own tool, in
that sample's second turn), and a plain answer without tools.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrl.batch import Batch
from rayrl.envs import Episode, HermesParser, Tool, Toolbox, ToolEnvironment, ToolRunner, build_tool
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import positions_from_mask
from rayrl.rollout.agent.format import TurnFormat

HANG_TIMEOUT_S = 1.0
MAX_TOOL_RESPONSE_TOKENS = 64


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@dataclass
class Script:
    """A prompt and its assistant turns; the observations come from the real tools."""

    prompt: str
    turns: list[str]


SCRIPTS = {
    "add": Script("add 2 and 3", [call("calculator", expression="2+3"), "The answer is 5."]),
    "mul": Script("multiply 4 by 5", [call("calculator", expression="4*5"), "The answer is 20."]),
    "both": Script(
        "sum two pairs",
        [
            call("calculator", expression="1+1") + call("calculator", expression="2+2"),
            "Got 2 and 4.",
        ],
    ),
    "bad": Script(
        "write a broken call",
        ['<tool_call>{"name": "calculator", "arguments": {</tool_call>', "Oops."],
    ),
    "unknown": Script("ask the weather", [call("weather", city="Paris"), "No weather tool."]),
    "hang": Script("call the sleepy tool", [call("sleepy"), "It hung."]),
    "boom": Script("call the boom tool", [call("boom"), "It broke."]),
    "junk": Script("call the junk tool", [call("junk"), "Junk seen."]),
    "loop": Script(
        "double until eight",
        [
            call("calculator", expression="1+1"),
            call("calculator", expression="2+2"),
            call("calculator", expression="4+4"),
            "Reached 8.",
        ],
    ),
    "long": Script("read the long blob", [call("blob"), "Read it."]),
    "wait": Script("wait for your peer", [call("wait_for_peer"), "Peer came."]),
    "signal": Script(
        "signal your peer",
        [call("calculator", expression="3+3"), "Now the signal. " + call("signal"), "Signalled."],
    ),
    "chat": Script("say hello", ["Hello there, no tools needed."]),
}

# Scripts the default agent model is not taught (`train_agent_model(names=...)` names them).
EXTRA_SCRIPTS = {
    "count": Script(
        "count three times",
        [call("counter"), call("counter"), call("counter"), "Counted to 3."],
    ),
}


class Sleepy(Tool):
    """Hangs far past its timeout."""

    name = "sleepy"
    timeout_s = HANG_TIMEOUT_S

    def __init__(self, config=None, schema=None):
        super().__init__(config, schema)
        self.wake = threading.Event()

    def execute(self, arguments, state):
        self.wake.wait(60)
        return "woke up"


class Boom(Tool):
    name = "boom"

    def execute(self, arguments, state):
        raise RuntimeError("exploded")


class Junk(Tool):
    """Returns garbage: not a string, with a lone surrogate and control characters."""

    name = "junk"

    def execute(self, arguments, state):
        return {"bytes": "\ud800\x00\x07", "n": [1, None, 2.5]}


class Blob(Tool):
    name = "blob"

    def execute(self, arguments, state):
        return " ".join(f"word{i}" for i in range(400))


class Handshake:
    """Two tools: ``wait_for_peer`` blocks until ``signal`` is called (by another sample),
    or for ``timeout_s``; ``times`` records when each call started and ended."""

    def __init__(self, timeout_s: float = 30.0, signalled: bool = False) -> None:
        self.event = threading.Event()
        if signalled:
            self.event.set()
        self.times: dict[str, float] = {}
        handshake = self

        class WaitForPeer(Tool):
            name = "wait_for_peer"

            def execute(self, arguments, state):
                handshake.times["wait_start"] = time.perf_counter()
                arrived = handshake.event.wait(timeout_s + 5)
                handshake.times["wait_end"] = time.perf_counter()
                return "peer arrived" if arrived else "peer never came"

        class Signal(Tool):
            name = "signal"

            def execute(self, arguments, state):
                handshake.times["signal"] = time.perf_counter()
                handshake.event.set()
                return "signal sent"

        WaitForPeer.timeout_s = timeout_s
        self.tools = [WaitForPeer(), Signal()]


class Counter(Tool):
    """Answers each call of an episode with the episode's call count (1, 2, 3...), and,
    when ``config["log"]`` names a file, appends the calling process's id to it: a
    tensor-parallel rollout must run it once per call, on its TP rank 0."""

    name = "counter"

    def create(self, create_kwargs):
        return {"calls": 0}

    def execute(self, arguments, state):
        state["calls"] += 1
        if self.config.get("log"):
            with open(self.config["log"], "a") as log:
                log.write(f"{os.getpid()}\n")
        return str(state["calls"])


def make_tools(handshake: Handshake | None = None, extra: Sequence[Tool] = ()) -> list[Tool]:
    """Fresh instances of every tool the taught scripts call (but ``weather``), then
    ``extra`` (the `counter` of `EXTRA_SCRIPTS`). The tools' schemas are part of every
    prompt, so the default set stays what the default agent model was trained with."""
    handshake = handshake or Handshake()
    tools = [build_tool("calculator"), Sleepy(), Boom(), Junk(), Blob()]
    return [*tools, *handshake.tools, *extra]


def script(name: str) -> Script:
    """The script ``name``, taught by default (`SCRIPTS`) or not (`EXTRA_SCRIPTS`)."""
    return SCRIPTS[name] if name in SCRIPTS else EXTRA_SCRIPTS[name]


def render_prompt(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(chat, add_special_tokens=False)


def make_prompts(tokenizer, names: list[str], step: int = 0) -> Batch:
    """A left-padded prompt batch of these scripts, uid = script name."""
    seqs = [render_prompt(tokenizer, script(n).prompt) for n in names]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    raw = [[{"role": "user", "content": script(n).prompt}] for n in names]
    columns = {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}
    return Batch.from_dict({**columns, "uid": list(names), "raw_prompt": raw}, meta={"step": step})


def episode_tokens(
    tokenizer, fmt: TurnFormat, script: Script, tools
) -> tuple[list[int], list[int]]:
    """The scripted episode as (token ids, 1 where the model must predict the token)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    box = Toolbox.of(
        tools, runner=ToolRunner(default_timeout_s=HANG_TIMEOUT_S), max_parallel_calls=4
    )
    env = ToolEnvironment(toolbox=box, parser=HermesParser())
    env.reset(Episode("train", [], {}, {}))
    ids = render_prompt(tokenizer, script.prompt)
    targets = [0] * len(ids)
    for turn in script.turns:
        sampled = tokenizer.encode(turn, add_special_tokens=False) + [im_end]
        ids += sampled
        targets += [1] * len(sampled)
        if "<tool_call>" not in turn:
            break
        messages = env.step([], turn).messages()
        observation = fmt.observation(messages, im_end).tokens
        ids += observation
        targets += [0] * len(observation)
    return ids, targets


def train_agent_model(out_dir: Path, max_steps: int = 1500, names: tuple[str, ...] = ()) -> Path:
    """Build and train the tool-using tiny model (module docstring) on the scripts
    ``names`` (default: all); return its directory."""
    scripts = [script(n) for n in names] if names else list(SCRIPTS.values())
    corpus = [s.prompt for s in scripts] + [t for s in scripts for t in s.turns]
    path = build_tiny_model(
        out_dir,
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab_size=640,
        corpus=corpus * 4,
        max_position=1024,
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    fmt = TurnFormat(tokenizer, max_message_tokens=MAX_TOOL_RESPONSE_TOKENS)
    extra = [Counter()] if any(n in EXTRA_SCRIPTS for n in names) else []
    tools = make_tools(Handshake(signalled=True), extra)
    examples = [episode_tokens(tokenizer, fmt, s, tools) for s in scripts]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = torch.zeros_like(ids, dtype=torch.bool)
    for row, (seq, target) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        targets[row, : len(seq)] = torch.tensor(target, dtype=torch.bool)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    labels = ids[:, 1:]
    wanted = targets[:, 1:]
    model.train()
    for step in range(max_steps):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[wanted], labels[wanted])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # Stop once every scripted token is the argmax by a wide margin (a low loss), so
        # that the small numeric differences of other batches cannot flip a choice.
        learned = step % 25 == 24 and loss.item() < 0.01
        if learned and bool((logits.argmax(-1)[wanted] == labels[wanted]).all()):
            break
    else:
        raise AssertionError(f"the agent model did not learn its scripts in {max_steps} steps")
    model.eval()
    model.save_pretrained(path)
    return path

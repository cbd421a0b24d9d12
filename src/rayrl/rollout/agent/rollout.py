"""Multi-turn rollout: episodes of model turns and tool (or environment) answers.

`MultiTurnRollout(engine, tools=..., config=MultiTurnConfig(...)).generate(prompts,
sampling)` takes the same prompt batch as an engine's ``generate`` and returns the
same Batch contract (`rayrl.rollout.contract`), where each response is a
whole episode:

- ``responses`` are exactly the tokens the model sampled plus the tokens appended
  for tool responses and turn separators (`TurnFormat`), in order; a chat is never
  re-tokenised, so the trainer scores the very tokens the model saw;
- ``response_mask`` is 1 on sampled tokens only, 0 on every appended one;
  ``attention_mask`` covers both; ``rollout_log_probs`` are the sampled tokens'
  (0 on appended ones);
- ``finish_reason`` is ``stop`` (the episode ended) or ``length`` (the response limit
  cut a turn, or an observation did not fit: the context limit).

and, per sample, ``num_turns`` (verl's count: assistant turns + observations + 1),
``tool_stats`` (per configured tool: calls, errors, timeouts, latency_s),
``multi_turn_events`` (malformed calls, unknown tools, bad arguments, calls over the
per-turn limit, environment errors and timeouts, truncated observations),
``turn_scores`` (rewards the environment gave per turn), ``tool_rewards`` (rewards
tools gave at the end, by tool), ``trajectory`` (the conversation: the prompt's
messages, each assistant message with its parsed tool calls, each observation as the
model saw it), for the reward function, and the episode's own record of its response
(``rollout_token_ids``, ``rollout_sampled``: 1 on sampled tokens), built turn by turn
apart from the engine's output, for the trainer's token check. `multi_turn_metrics` sums them up as verl's
metrics.

A vision-language model's episode starts from its prompt's images (the prompt rows'
``multi_modal_inputs``, fed with the prompt) and may be shown more: a tool or an
environment whose observation holds image parts (`rayrl.rollout.agent.format`; e.g.
a tool returning ``ToolResult(text, images=[...])``). Each row's ``multi_modal_inputs``
then holds the prompt's images and its observations' after them, in order, and the
response columns of the observations' placeholders
(`rayrl.models.vision_language.RESPONSE_IMAGES`), so that the actor's and reference's
forwards see every image of the episode where the rollout did.

The environment of a row is its ``agent_name`` column (verl's; ``tool_agent``,
``single_turn_agent``, a registered or dotted-path environment), else
``config.environment``; its tools' per-episode arguments come from
``extra_info.tools_kwargs``. Every sample is seeded from (seed, step, sample uid) as
in single-turn rollouts, a sampled token's position being its column in the
response, so an episode replays alone, in any batch, in any process (given tools
that answer the same).

Turns interleave in the one turn loop (`rayrl.rollout.loop`) over either
engine's request API: a sample waiting for its tools is parked with its KV cache and
the others keep decoding (continuous batching); its answer is prefilled onto its cache.

On a tensor-parallel native engine every rank of the replica calls ``generate`` with
the same prompts; the environments and tools run on TP rank 0 only, whose answers the
other ranks apply in lockstep (`rayrl.rollout.native.tp_turns`), and every rank
returns TP rank 0's output (the worker keeps the replica's first rank's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.config.multi_turn import MultiTurnConfig, check_multi_turn
from rayrl.envs import (
    Environment,
    Episode,
    Tool,
    Toolbox,
    ToolRunner,
    build_tools,
    episode_fields,
    make_environment,
    make_parser,
)
from rayrl.envs.toolbox import CLOSE_ERROR, OK, TIMEOUT
from rayrl.models.vision_language import IMAGE_COLUMN, IMAGE_INPUTS, RESPONSE_IMAGES
from rayrl.rollout.agent.episodes import EVENT_KEYS, Episodes, EpisodeState
from rayrl.rollout.agent.format import TurnFormat
from rayrl.rollout.base import RolloutEngine
from rayrl.rollout.contract import (
    Responses,
    SampleRows,
    assemble_output,
    sample_rows,
)
from rayrl.rollout.native import NativeRolloutEngine
from rayrl.rollout.native.tp import TensorParallel
from rayrl.rollout.native.tp_turns import FollowerTurns
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.turns import TurnDriver

__all__ = ["Decode", "MultiTurnConfig", "MultiTurnRollout", "multi_turn_metrics"]


# decode(token_lists, sampling, keys, driver, images) -> the samples' responses (every
# turn); images: per prompt, its pixel inputs (`rayrl.rollout.loop.Job.images`) or None
Decode = Callable[
    [list[list[int]], SamplingParams, np.ndarray, TurnDriver, Sequence[Any] | None], Responses
]


class MultiTurnRollout:
    """Multi-turn episodes on a rollout engine (see the module docstring).

    Args:
        engine: an `HFRolloutEngine` or a `NativeRolloutEngine` (a TypeError for another).
        tools: tools, or config entries for `rayrl.envs.build_tools`.
        config: the episode settings: the config's ``actor_rollout_ref.rollout.multi_turn``
            group (`rayrl.config.multi_turn.MultiTurnConfig`, checked here as at load).
        tokenizer: the model's tokenizer (default: the engine's).
        interactions: simulated users by name (verl's interactions,
            `rayrl.envs.interaction`), for the environments that take them.
        environment: the environment of rows without an ``agent_name`` (verl's
            ``agent.default_agent_loop``).
        chat_template_kwargs: extra arguments of the chat template
            (``data.apply_chat_template_kwargs``).
        vision: a vision-language model's image processor
            (`rayrl.data.vision.VisionProcessor`), for observations that show images.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tools: Iterable[Tool | Any] = (),
        config: MultiTurnConfig | None = None,
        tokenizer=None,
        interactions: Mapping[str, Any] | None = None,
        *,
        environment: str = "tools",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        vision: Any = None,
    ) -> None:
        from rayrl.rollout.hf.engine import HFRolloutEngine  # imports transformers

        if not isinstance(engine, HFRolloutEngine | NativeRolloutEngine):
            raise TypeError(
                f"multi-turn rollout runs on the hf or native engine, not {type(engine).__name__}."
            )
        self.engine = engine
        self.config = config or MultiTurnConfig()
        check_multi_turn(self.config)
        self.environment = environment
        self.interactions = dict(interactions or {})
        self.tokenizer = tokenizer or engine.tokenizer
        if self.tokenizer is None:
            raise ValueError(
                "multi-turn rollout needs the model's tokenizer (to parse turns and format "
                "tool responses); build the engine with tokenizer=... or pass tokenizer=."
            )
        c = self.config
        self.parser = make_parser(
            c.format, **({"stop_at_call_end": True} if c.stop_at_tool_call_end else {})
        )
        runner = ToolRunner(c.max_concurrent_tools, default_timeout_s=c.tool_timeout_s)
        self.toolbox = Toolbox.of(
            build_tools(tools), runner=runner, max_parallel_calls=c.max_parallel_calls
        )
        self.format = TurnFormat(
            self.tokenizer,
            max_message_tokens=c.max_tool_response_length,
            truncate_side=c.tool_response_truncate_side,
            template_kwargs=dict(chat_template_kwargs or {}),
            keep_special_tokens=self.parser.keeps_special_tokens,
            vision=vision,
        )
        self.format.pieces(("tool",))  # a template that cannot render tool turns fails here
        self._environment(environment)  # an unknown environment fails here, not per row
        self.last_stats: dict[str, float] = {}

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI schemas, for the prompt's chat template (``tools=``)."""
        return self.toolbox.schemas

    # -------------------------------------------------------------- generate
    def generate(
        self, prompts: Batch, sampling: SamplingParams, decode: Decode | None = None
    ) -> Batch:
        """Episodes for ``sampling.n`` samples of each prompt (module docstring).

        ``decode(token_lists, sampling, keys, driver, images)`` runs the samples' turns (default:
        the engine's own loop, ``engine.generate_token_ids``); a rollout service passes
        its shared loop. When it raises (an aborted call), the episodes' environments
        are closed before the error goes on."""
        decode = decode or self._engine_decode
        samples = sample_rows(prompts, sampling.n, sampling.seed, "MultiTurnRollout.generate")
        sampling = self._turn_sampling(sampling)
        tp = self._tensor_parallel()
        if tp is not None and tp.rank != 0:
            return self._follow(samples, sampling, tp, decode)
        start = time.perf_counter()
        episodes = Episodes(
            [self._episode(samples.rows, i, uid) for i, uid in enumerate(samples.uids)],
            self.format,
            eos_ids=self.engine.eos_ids,
            width=sampling.max_new_tokens,
            max_assistant_turns=self.config.max_assistant_turns,
            max_user_turns=self.config.max_user_turns,
            env_timeout_s=self.config.env_timeout_s,
        )
        try:
            out = self._decode(samples, sampling, episodes, decode)
        except BaseException:
            self._close(episodes)
            raise
        try:
            batch = self._assemble(samples, out, sampling, episodes, start)
        except BaseException as err:
            if tp is not None:  # the other ranks wait for this rank's output
                tp.broadcast_object(f"{type(err).__name__}: {err}")
            raise
        if tp is not None:
            tp.broadcast_object((batch, self.last_stats))
        return batch

    def _assemble(
        self, samples: SampleRows, out: Responses, sampling, episodes, start: float
    ) -> Batch:
        rows, uids = samples.rows, samples.uids
        masks = [
            episodes.finish(i, out.tokens[i, : out.lengths[i]].numpy()) for i in range(len(rows))
        ]
        closing = self._close(episodes)
        batch = assemble_output(rows, uids, out, sampling.max_new_tokens, self.engine.pad_id)
        self._fill(batch, episodes, masks, closing)
        self.last_stats = {
            "multi_turn/rollout_s": time.perf_counter() - start,
            "timing_s/tools": episodes.busy_s,
            "multi_turn/env_steps": float(episodes.turns_handled),
        }
        return batch

    def _tensor_parallel(self) -> TensorParallel | None:
        """The engine's TP group (None: one rank holds the whole model)."""
        return getattr(self.engine, "tp", None)

    def _follow(self, samples: SampleRows, sampling, tp: TensorParallel, decode) -> Batch:
        """A TP rank other than 0: decode in lockstep with TP rank 0, whose environments
        answer every turn (`tp_turns`), then return TP rank 0's output."""
        self._decode(samples, sampling, FollowerTurns(), decode)
        shared = tp.broadcast_object(None)
        if isinstance(shared, str):
            raise RuntimeError(
                f"multi-turn rollout (TP rank {tp.rank} of {tp.size}): TP rank 0 failed to "
                f"assemble the episodes ({shared}); see TP rank 0's log"
            )
        batch, self.last_stats = shared
        return batch

    def _turn_sampling(self, sampling: SamplingParams) -> SamplingParams:
        stops = tuple(s for s in self.parser.stop if s not in sampling.stop)
        return replace(sampling, stop=sampling.stop + stops) if stops else sampling

    def _decode(self, samples: SampleRows, sampling, episodes, decode: Decode) -> Responses:
        """The episodes' turns through ``decode`` (the one turn loop)."""
        if not len(samples.rows):
            none = torch.zeros(0, 0)
            return Responses(none.long(), none.sum(1).long(), none, none.sum(1).bool())
        images = samples.prompts.non_tensors.get(IMAGE_COLUMN)
        images = None if images is None else list(images)
        return decode(samples.token_lists(), sampling, samples.keys.numpy(), episodes, images)

    def _engine_decode(self, token_lists, sampling, keys, driver, images) -> Responses:
        extra = {"images": images} if images is not None else {}  # the HF engine's
        return self.engine.generate_token_ids(
            token_lists, sampling, keys=keys, turns=driver, **extra
        )

    def _episode(self, rows: Batch, i: int, uid: str) -> EpisodeState:
        row = {k: v[i] for k, v in rows.non_tensors.items()}
        agent, tools_kwargs = episode_fields(row)
        extra_info = row.get("extra_info")
        extra = extra_info if isinstance(extra_info, Mapping) else {}
        messages = _messages(row.get("raw_prompt"))
        if messages is None:
            ids = rows.tensors["input_ids"][i][rows.tensors["attention_mask"][i].bool()]
            messages = [{"role": "user", "content": self.format.decode(ids.tolist())}]
        episode = Episode(uid, messages, dict(extra), tools_kwargs, row.get("data_source"))
        state = EpisodeState(None, [dict(m) for m in messages])
        try:
            env = self._environment(agent or self.environment)
            env.reset(episode)
        except Exception as err:  # a broken row or environment: a single-turn sample
            state.events["env_errors"] += 1
            state.errors.append(f"environment {agent or self.environment!r}: {err}")
            return state
        state.env = env
        return state

    def _environment(self, name: str) -> Environment:
        return make_environment(
            name,
            config=self.config.environment_config,
            toolbox=self.toolbox,
            parser=self.parser,
            interactions=self.interactions,
        )

    def _close(self, episodes: Episodes) -> list[dict[str, float]]:
        """Close every environment (under the step timeout); the rewards they give."""
        futures = [
            None if s.env is None else episodes.runner.submit(s.env.close, name="env-close")
            for s in episodes.states
        ]
        rewards = []
        for state, future in zip(episodes.states, futures, strict=True):
            outcome = None if future is None else future.result()
            if outcome is not None and not outcome.ok:
                state.events["env_errors"] += 1
                state.errors.append(f"environment close: {outcome.error or 'timed out'}")
            value = outcome.value if outcome is not None and outcome.ok else None
            rewards.append(dict(value) if isinstance(value, Mapping) else {})
        return rewards

    def _fill(self, batch: Batch, episodes: Episodes, masks, rewards) -> None:
        width = batch.tensors["responses"].shape[1]
        sampled = torch.zeros(len(masks), width, dtype=batch.tensors["response_mask"].dtype)
        for i, mask in enumerate(masks):
            sampled[i, : len(mask)] = torch.from_numpy(mask[:width])
        batch.tensors["response_mask"] = batch.tensors["response_mask"] * sampled
        batch.tensors["rollout_log_probs"] = batch.tensors["rollout_log_probs"] * sampled
        states = episodes.states
        tool_names = list(self.toolbox.tools)
        columns = {
            "num_turns": [s.assistant_turns + s.user_turns + 1 for s in states],
            "tool_stats": [_tool_stats(s.env, tool_names) for s in states],
            "multi_turn_events": [_events(s) for s in states],
            "turn_scores": [list(s.turn_scores) for s in states],
            "tool_rewards": rewards,
            "trajectory": [s.conversation for s in states],
        }
        records = [s.recorded() for s in states]
        columns["rollout_token_ids"] = [tokens for tokens, _ in records]
        columns["rollout_sampled"] = [sampled for _, sampled in records]
        if IMAGE_COLUMN in batch.non_tensors or any(s.images for s in states):
            columns[IMAGE_COLUMN] = _episode_images(batch.non_tensors.get(IMAGE_COLUMN), states)
        for name, values in columns.items():
            column = np.empty(len(states), dtype=object)
            for i, value in enumerate(values):  # one object each, whatever their shapes
                column[i] = value
            batch.non_tensors[name] = column


def _episode_images(prompt_images, states: Sequence[EpisodeState]) -> list[dict]:
    """Each row's images: its prompt's, then its observations' (concatenated in order),
    and the response columns of the observations' placeholders (module docstring)."""
    rows = []
    for i, state in enumerate(states):
        own = dict(prompt_images[i] or {}) if prompt_images is not None else {}
        if state.images:
            parts = ([own] if own else []) + state.images
            own = {k: torch.cat([torch.as_tensor(p[k]) for p in parts]) for k in IMAGE_INPUTS}
            own[RESPONSE_IMAGES] = torch.tensor(state.image_columns, dtype=torch.long)
        rows.append(own)
    return rows


def _messages(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    try:
        messages = [dict(m) for m in raw]
    except (TypeError, ValueError):
        return None
    return messages if all("role" in m for m in messages) else None


def _tool_stats(env: Environment | None, names: Sequence[str]) -> dict[str, dict[str, float]]:
    stats = {n: {"calls": 0, "errors": 0, "timeouts": 0, "latency_s": 0.0} for n in names}
    for event in env.events if env is not None else ():
        entry = stats.get(event.tool or "")
        if entry is None or event.status == CLOSE_ERROR:
            continue
        entry["calls"] += 1
        entry["errors"] += event.status not in (OK, TIMEOUT)
        entry["timeouts"] += event.status == TIMEOUT
        entry["latency_s"] += event.latency_s
    return stats


def _events(state: EpisodeState) -> dict[str, int]:
    """The episode's own events plus its tool calls' failures that name no tool's stats
    (malformed calls, unknown tools, bad arguments, calls over the per-turn limit)."""
    events = dict(state.events)
    for event in state.env.events if state.env is not None else ():
        if event.status in events:
            events[event.status] += 1
        elif event.status == CLOSE_ERROR:
            events["env_errors"] += 1
    return events


def multi_turn_metrics(batch: Batch, stats: Mapping[str, float] | None = None) -> dict[str, float]:
    """verl-named metrics of a multi-turn rollout's output (and its ``last_stats``):
    ``multi_turn/num_turns/{mean,max,min}``, ``tool/<name>/{calls,errors,timeouts}``
    (sums), ``tool/<name>/latency_s`` (mean per call), ``multi_turn/<event>`` (sums),
    ``timing_s/tools``."""
    turns = np.asarray(batch.non_tensors["num_turns"], dtype=np.float64)
    metrics = {
        "multi_turn/num_turns/mean": float(turns.mean()) if len(turns) else 0.0,
        "multi_turn/num_turns/max": float(turns.max()) if len(turns) else 0.0,
        "multi_turn/num_turns/min": float(turns.min()) if len(turns) else 0.0,
    }
    totals: dict[str, dict[str, float]] = {}
    for per_sample in batch.non_tensors["tool_stats"]:
        for name, entry in per_sample.items():
            total = totals.setdefault(name, dict.fromkeys(entry, 0.0))
            for key, value in entry.items():
                total[key] += value
    for name, total in totals.items():
        for key in ("calls", "errors", "timeouts"):
            metrics[f"tool/{name}/{key}"] = float(total[key])
        metrics[f"tool/{name}/latency_s"] = total["latency_s"] / max(total["calls"], 1.0)
    for key in EVENT_KEYS:
        metrics[f"multi_turn/{key}"] = float(
            sum(e[key] for e in batch.non_tensors["multi_turn_events"])
        )
    if stats:
        metrics.update({k: float(v) for k, v in stats.items()})
    return metrics

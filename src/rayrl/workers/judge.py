"""The LLM judge's server: a judge model in a rollout engine, behind an OpenAI-compatible
HTTP server (`rayrl.rollout.chat_server`), for the reward to call.

`JudgeServer(config)` loads `reward_model.model.path` into the engine that
`reward_model.rollout` names (verl's `reward.reward_model.rollout.*`: `auto` takes
rayrl's native engine on a GPU where the model's family allows it, else the HF engine;
verl's vllm / sglang mean auto), wraps it in a `RolloutService` (its turn loop batches
concurrent requests into shared engine steps) and serves it on 127.0.0.1, or on the
node's IP when the judge has a pool of its own (`reward_model.enable_resource_pool`:
the reward workers may be on other nodes). Without a pool of its own, each reward worker
holds one in its process (`rayrl.workers.reward`); with one, each bundle of the judge
pool holds one in a `JudgeReplica` actor.

A judge that shares its process with a reward worker sleeps between scorings
(`reward_model.rollout.free_cache_engine`, as the rollout does while the actor trains):
`awake()` wakes it for one scoring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch

from rayrl.cluster.kv import KVStore
from rayrl.config.judge import JudgeRolloutConfig
from rayrl.config.judge_mode import judge_enabled, judge_on_own_pool
from rayrl.config.schema import RayRLConfig
from rayrl.controller import ONE_TO_ALL, Worker, register
from rayrl.rollout.chat_server import ChatServer
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.service import RolloutService

__all__ = [
    "JudgeServer",
    "JudgeWorker",
    "RemoteJudge",
    "judge_enabled",
    "judge_engine",
    "judge_engine_name",
    "judge_on_own_pool",
]

VERL_NAMES = ("vllm", "sglang", "trtllm")  # verl's engines: rayrl picks its own (auto)


def judge_engine_name(rollout: JudgeRolloutConfig, device: str, model_config: Any) -> str:
    """The engine `reward_model.rollout.name` means on `device` for this model."""
    from rayrl.rollout.base import AUTO, AUTO_ORDER, ROLLOUT_ENGINES

    name = AUTO if rollout.name in VERL_NAMES else rollout.name
    if name != AUTO:
        ROLLOUT_ENGINES.canonical(name)  # an unknown name: "did you mean"
        return name
    for candidate in AUTO_ORDER:
        if ROLLOUT_ENGINES.get(candidate).unsupported_reason(device, model_config) is None:
            return candidate
    return "hf"


def judge_engine(rollout: JudgeRolloutConfig, model_path: str, device: str) -> Any:
    """The judge model loaded in its engine, on `device` ("cpu" or "cuda:N"): bf16 or
    `rollout.dtype` on a GPU, float32 on a CPU."""
    from transformers import AutoConfig

    if rollout.tensor_model_parallel_size != 1:
        raise ValueError(
            f"reward_model.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}"
            ": rayrl's judge runs one replica per GPU; set it to 1 and, for more throughput, "
            "more replicas (reward_model.enable_resource_pool with n_gpus_per_node)"
        )
    kind = torch.device(device).type
    dtype = rollout.dtype if kind == "cuda" else "float32"
    name = judge_engine_name(rollout, kind, AutoConfig.from_pretrained(model_path))
    if name == "native":
        from rayrl.rollout.native import NativeRolloutEngine

        return NativeRolloutEngine(
            model_path=model_path,
            dtype=dtype,
            device=device,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_num_seqs=min(rollout.max_num_seqs, 1024),
            max_model_len=rollout.prompt_length + rollout.response_length,
        )
    from rayrl.rollout.hf.engine import HFRolloutEngine

    return HFRolloutEngine(model_path=model_path, dtype=dtype, device=device, cache="dynamic")


def judge_sampling(rollout: JudgeRolloutConfig) -> SamplingParams:
    """What a request leaves out samples by (`reward_model.rollout`)."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=max(rollout.top_k, 0),
        do_sample=rollout.do_sample,
        seed=rollout.seed,
        max_new_tokens=rollout.response_length,
    )


class JudgeServer:
    """The judge model served over HTTP (module docstring): `address` ("host:port",
    verl's `reward_router_address`), `tokenizer` (verl's `reward_model_tokenizer`),
    `stats()`, `awake()`, `close()`.

    Args:
        config: the run's config (`reward_model.*`).
        device: where the model runs ("cpu", "cuda:N").
        host: the address to listen on (127.0.0.1, or the node's IP for other nodes).
        sleeps: sleep between scorings (the judge shares a process: `awake`).
    """

    def __init__(
        self, config: RayRLConfig, device: str, host: str = "127.0.0.1", sleeps: bool = False
    ) -> None:
        rm = config.reward_model
        rollout = rm.rollout
        self.engine = judge_engine(rollout, str(rm.model.path), device)
        self.tokenizer = self.engine.tokenizer
        if not self.engine.serves_requests:
            raise ValueError(
                f"reward_model.model.path={rm.model.path}: the {type(self.engine).__name__} "
                "cannot serve requests for this model (sliding-window attention or a vision "
                "model); the judge needs a decoder it can batch requests on"
            )
        self.service = RolloutService(self.engine)
        self.server = ChatServer(
            self.service,
            self.tokenizer,
            model_name=str(rm.model.path),
            defaults=judge_sampling(rollout),
            max_prompt_tokens=rollout.prompt_length,
            max_response_tokens=rollout.response_length,
            max_num_seqs=rollout.max_num_seqs,
            host=host,
        )
        self.sleeps = sleeps and rollout.free_cache_engine
        if self.sleeps:
            self.engine.sleep()

    @property
    def address(self) -> str:
        return self.server.address

    def stats(self) -> dict[str, float]:
        return self.server.stats()

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The engine awake for one scoring, asleep after it (when it sleeps at all)."""
        if not self.sleeps:
            yield
            return
        self.service.wake()
        try:
            yield
        finally:
            self.service.sleep()

    def close(self) -> None:
        self.server.close()


def judge_source(config: RayRLConfig, address: str, tokenizer: Any) -> Any:
    """The reward source of a judge at `address`: the user's `compute_score` given verl's
    GenRM arguments (`rayrl.rewards.judge.genrm_kwargs`) through its reward manager, or
    the built-in judge (`reward.judge.*`)."""
    from rayrl.rewards import make_scorer, spec_from_config
    from rayrl.rewards.judge import LLMJudge, genrm_kwargs
    from rayrl.rewards.loader import DEFAULT_NAME, import_function
    from rayrl.rewards.verdicts import make_parser

    r, fn, judge = config.reward, config.custom_reward_function, config.reward.judge
    if fn.path:
        user = import_function(fn.path, fn.name or DEFAULT_NAME)
        kwargs = {**r.reward_kwargs, **fn.reward_kwargs, **genrm_kwargs(user, address, tokenizer)}
        spec = spec_from_config(fn.path, fn.name, kwargs)
        return make_scorer(r.reward_manager.name, spec, r.num_workers, r.timeout_s)
    assert judge.template is not None  # judge_enabled
    return LLMJudge(
        address,
        judge.template,
        make_parser(judge.parser, judge.labels, judge.score_range),
        system=judge.system,
        max_tokens=judge.max_tokens,
        temperature=judge.temperature,
        concurrency=judge.concurrency,
        timeout_s=judge.timeout_s,
    )


def server_figures(
    before: dict[str, Any], after: dict[str, Any], wall_s: float
) -> dict[str, float]:
    """A scoring's judge figures from the server's counts before and after it: verdict
    tokens per second of the scoring's wall time, mean request latency, mean batch."""
    requests = after["requests"] - before["requests"]
    steps = after["steps"] - before["steps"]
    tokens = after["completion_tokens"] - before["completion_tokens"]
    out = {"judge/tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0}
    if requests:
        out["judge/latency_s"] = (after["request_s"] - before["request_s"]) / requests
    if steps:
        out["judge/batch"] = (after["stepped"] - before["stepped"]) / steps
    return out


def check_judge(config: RayRLConfig) -> None:
    """The built-in judge's settings, checked on the driver before Ray starts: a template
    that shows the judge the response, a known parser with a valid map or range."""
    from rayrl.config.errors import ConfigError
    from rayrl.registry import UnknownNameError
    from rayrl.rewards.verdicts import make_parser

    judge = config.reward.judge
    if "{response}" not in str(judge.template):
        raise ConfigError(
            f"reward.judge.template={judge.template!r} has no {{response}}: the judge would "
            "never see the response; write it with {question}, {response} and {ground_truth}"
        )
    try:
        make_parser(judge.parser, judge.labels, judge.score_range)
    except (ValueError, UnknownNameError) as exc:
        raise ConfigError(str(exc)) from None


JUDGE_KV = "judge"  # the run's KV namespace of the replicas' addresses, by rank


class JudgeWorker(Worker):
    """One judge replica on the judge's own pool: a `JudgeServer` on the node's IP, so
    that reward workers on any node reach it. It never sleeps (the pool is its own).
    Its address goes into the run's KV store under its rank: a replica that replaces a
    lost one (another process, another port) is found there by the reward workers."""

    def init_worker(self, config: RayRLConfig) -> None:
        import ray

        from rayrl.workers.model_placement import reward_model_placement

        device, _ = reward_model_placement()
        self.judge = JudgeServer(config, device, host=ray.util.get_node_ip_address())
        self.kv.put(
            str(self.rank), self.judge.address, namespace=JUDGE_KV, writer=f"judge {self.rank}"
        )

    @register(dispatch=ONE_TO_ALL)
    def address(self) -> str:
        return self.judge.address

    @register(dispatch=ONE_TO_ALL)
    def stats(self) -> dict[str, float]:
        return self.judge.stats()


class RemoteJudge:
    """What a reward worker holds of a judge replica on the judge's pool: its address
    (reward worker i uses replica i mod replicas), read from the run's KV store where
    each replica writes it, the judge's tokenizer, and the replica's counts read over
    HTTP (``GET /stats``: a replica that is gone fails it, and so the scoring, and the
    step's recovery replaces the replica). `refresh` reads the address again: a
    replacement writes its own."""

    def __init__(self, config: RayRLConfig, rank: int, kv: KVStore) -> None:
        from transformers import AutoTokenizer

        rm = config.reward_model
        self.replica, self.kv = rank % (rm.nnodes * rm.n_gpus_per_node), kv
        self.address = kv.get(str(self.replica), namespace=JUDGE_KV)
        if self.address is None:
            raise RuntimeError(
                f"reward rank {rank}: judge replica {self.replica} wrote no address into "
                "the run's KV store; the judge's pool starts before the reward workers, "
                "so it failed to start: read its worker log"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(rm.model.path))

    def refresh(self) -> bool:
        """The replica's address as its worker last wrote it; True when it moved."""
        address = self.kv.get(str(self.replica), self.address, namespace=JUDGE_KV)
        moved, self.address = address != self.address, address
        return cast(bool, moved)

    def stats(self) -> dict[str, float]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://{self.address}/stats", timeout=30) as reply:
            return dict(json.loads(reply.read()))

    def awake(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass

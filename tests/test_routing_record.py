"""The native engine's record of each token's experts (``record_routes``), on CPU in fp32,
against the experts transformers' own mixture-of-experts modules choose for the same
tokens (top-k of each router's softmax, from ``output_router_logits``).

Every position of prompt and response is compared, whatever path its KV took: chunked
prefills, the n samples of a prompt forking from one prefill (the last block copied),
prefix-cache hits of a second call, preempted samples recomputed, and the tokens a
multi-turn episode appends (prefilled between turns). The record reaches the rollout
Batch as ``routed_experts``, aligned with ``input_ids``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_cases import MOE_FAMILIES, PROMPTS, SMALL, family_model
from native_toys import InstantTurns
from rayrl.algos.routing import ROUTES, as_index, routes_dtype, routing_differs, unrouted
from rayrl.batch import Batch
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.families import spec_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SAMPLED = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=3)


def transformers_routing(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), moe layers, k]``: each router's top-k experts, as transformers
    computes the routing (softmax of the router logits in float32, top-k)."""
    with torch.no_grad():
        ids = torch.tensor([tokens], device=model.device)
        out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack(
        [torch.topk(logits.float().softmax(-1), k, dim=-1).indices for logits in out.router_logits],
        dim=1,
    ).cpu()


def check_against_transformers(model, tokens: list[int], record: torch.Tensor) -> int:
    """Assert the record's experts equal transformers' at every recorded position (all
    but possibly the last, which is never fed back); the positions compared."""
    assert record.shape[0] == len(tokens)
    index = as_index(record)
    recorded = index[:, 0, 0] >= 0
    assert bool(recorded[:-1].all()), recorded.tolist()
    differ = routing_differs(index[recorded], transformers_routing(model, tokens)[recorded])
    assert not bool(differ.any()), differ.nonzero().tolist()
    return int(recorded.sum())


def prompt_batch(prompts: list[list[int]]) -> Batch:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    batch = Batch({"input_ids": ids, "attention_mask": mask})
    batch.non_tensors["uid"] = np.array([f"p{i}" for i in range(len(prompts))], dtype=object)
    batch.meta["step"] = 1
    return batch


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_record_is_transformers_routing_in_the_rollout_batch(family):
    """Chunked prefill (8 tokens a step, 4-token blocks), two samples forking from each
    prompt, three sequences at once; then the same prompts again (prefix-cache hits):
    ``routed_experts`` holds transformers' experts at every real position."""
    model = family_model(family)
    engine = NativeRolloutEngine(model=model, record_routes=True, **SMALL, max_model_len=64)
    moe = spec_of(model.config).moe
    for _ in range(2):  # the second call finds the prompts in the prefix cache
        out = engine.generate(prompt_batch(PROMPTS), SAMPLED)
        routes, mask = out[ROUTES], out["attention_mask"].bool()
        assert routes.dtype == routes_dtype(moe.experts) == torch.uint8
        assert routes.shape == (*out["input_ids"].shape, sum(moe.layers), moe.top_k)
        assert bool((routes[~mask] == unrouted(torch.uint8)).all())  # padding
        for row in range(len(out)):
            tokens = out["input_ids"][row][mask[row]].tolist()
            check_against_transformers(model, tokens, routes[row][mask[row]])
    assert engine.last_stats["prefix_hit_tokens"] > 0  # the second call found the prompts


def test_preempted_samples_are_recorded_as_recomputed():
    """A cache of 12 blocks for three sequences: samples are preempted and recomputed;
    their records are still transformers' routing of the tokens they hold."""
    model = family_model("qwen3_moe")
    engine = NativeRolloutEngine(
        model=model, record_routes=True, **{**SMALL, "max_num_seqs": 4}, cpu_cache_tokens=48
    )
    prompts = [PROMPTS[3], PROMPTS[2], PROMPTS[3][::-1], PROMPTS[1]]
    sampling = SamplingParams(n=1, max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    out = engine.generate_token_ids(prompts, sampling)
    assert engine.last_stats["preemptions"] > 0
    for i, prompt in enumerate(prompts):
        tokens = prompt + out.tokens[i, : out.lengths[i]].tolist()
        check_against_transformers(model, tokens, out.routes[i])


def test_multi_turn_appended_tokens_are_recorded():
    """Episodes whose tools answer at once: the appended tokens are prefilled onto the
    samples' caches between turns, and recorded as the sampled ones are."""
    model = family_model("mixtral")
    engine = NativeRolloutEngine(model=model, record_routes=True, **SMALL, max_model_len=64)
    sampling = SamplingParams(
        n=1, max_new_tokens=24, temperature=1.0, seed=1, stop_token_ids=(7, 9)
    )
    out = engine.generate_token_ids(PROMPTS, sampling, turns=InstantTurns(24))
    appended = 0
    for i, prompt in enumerate(PROMPTS):
        response = out.tokens[i, : out.lengths[i]].tolist()
        appended += sum(t == 5 for t in response)
        check_against_transformers(model, prompt + response, out.routes[i])
    assert appended > 0  # some turn ended and had an answer appended


def test_nothing_is_recorded_unless_asked_or_for_a_dense_model():
    prompts = prompt_batch(PROMPTS[:2])
    plain = NativeRolloutEngine(model=family_model("qwen3_moe"), **SMALL, max_model_len=64)
    assert plain.routes is None and ROUTES not in plain.generate(prompts, SAMPLED)
    dense = NativeRolloutEngine(
        model=family_model("qwen2"), record_routes=True, **SMALL, max_model_len=64
    )
    assert dense.routes is None and ROUTES not in dense.generate(prompts, SAMPLED)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_tiny_moe_models_of_rayrl_models_tiny_record_too(tmp_path, family):
    """`rayrl models tiny --family` builds each mixture (4 experts, top-2, as its family
    configures the rest); the native engine loads it from disk and records transformers'
    routing of its samples."""
    from transformers import AutoModelForCausalLM

    from rayrl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / family, family=family, vocab_size=320)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert sum(spec_of(model.config).moe.layers) == 2  # every layer a mixture
    engine = NativeRolloutEngine(model_path=str(path), record_routes=True, **SMALL)
    out = engine.generate_token_ids(PROMPTS, SAMPLED)
    for i, record in enumerate(out.routes):
        tokens = PROMPTS[i // 2] + out.tokens[i, : out.lengths[i]].tolist()
        check_against_transformers(model, tokens, record)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_record_on_cuda_is_transformers_routing_but_bf16_ties(tmp_path, enforce_eager):
    """bf16 on CUDA, decode steps (and small prefills) in CUDA graphs or eager, the
    experts grouped: every position but the last is recorded, and nearly every decision
    is transformers' bf16 routing of the same tokens (bf16 may flip a near tie)."""
    from transformers import AutoModelForCausalLM

    from rayrl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", family="qwen3_moe", vocab_size=320)
    engine = NativeRolloutEngine(
        model_path=str(path), record_routes=True, enforce_eager=enforce_eager, max_num_seqs=8
    )
    assert engine.use_graphs != enforce_eager
    out = engine.generate_token_ids(PROMPTS, SAMPLED)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    same = total = 0
    for i, record in enumerate(out.routes):
        tokens = PROMPTS[i // 2] + out.tokens[i, : out.lengths[i]].tolist()
        index = as_index(record)
        assert record.device.type == "cpu" and len(record) == len(tokens)
        assert bool((index[:-1] >= 0).all()) and int(index.max()) < 4
        differ = routing_differs(index[:-1], transformers_routing(model, tokens)[:-1])
        same, total = same + int((~differ).sum()), total + differ.numel()
    assert same >= 0.95 * total, (same, total)

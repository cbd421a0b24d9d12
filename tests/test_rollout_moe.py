"""Mixtures of experts in the native engine (Qwen2-MoE, Qwen3-MoE, Mixtral), on CPU.

The families' tiny models (`family_cases.FAMILIES`: 4 or 8 experts, top-2, dense layers
beside sparse ones, a shared expert) also run in `test_rollout_families`' comparison
with transformers. Here: the routing against transformers' own router modules, the
three ways the experts run (the CPU reference, the grouped matmul and the dense
formulation of CUDA) against each other, the specs read from the configs, loading
checkpoints on disk (one tensor per expert) and updates in transformers' fused layout
while samples are in flight, the tensor-parallel split of every expert at TP=2 (gloo
processes) against one rank, and what the engine refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from family_cases import (
    GREEDY,
    MOE_FAMILIES,
    PROMPTS,
    SMALL,
    family_config,
    family_model,
    moe_tp_worker,
    outputs,
)
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.families import spec_of
from rayrl.rollout.native.moe import EXPERT_PATHS, moe_mlp, route
from rayrl.rollout.native.shards import Part, TPShard, check_tp_size
from rayrl.rollout.native.spec import MoESpec, UnsupportedModelError
from rayrl.rollout.native.tp_weights import _piece, _rows_held
from rayrl.rollout.native.weights import LayerWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ONE = dict(SMALL, max_model_len=64)


def _act(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize(
    ("family", "router"),
    [
        ("qwen2_moe", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter"),
        ("qwen3_moe", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter"),
        ("mixtral", "mixtral.modeling_mixtral.MixtralTopKRouter"),
    ],
)
def test_routing_is_transformers_own_in_bfloat16(family, router):
    """Softmax in float32, top-k, renormalised where the family says, the weights'
    dtype: bit for bit what the family's router module returns."""
    import importlib

    config = family_config(family, norm_topk_prob=True, num_experts_per_tok=3)
    module, name = router.rsplit(".", 1)
    hf = getattr(importlib.import_module(f"transformers.models.{module}"), name)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        hf = hf.to(torch.bfloat16)
        x = torch.randn(9, config.hidden_size, generator=gen).to(torch.bfloat16)
        _, weights, chosen = hf(x)
    got_weights, got_chosen = route(x, hf.weight, spec_of(config).moe)
    assert torch.equal(got_chosen, chosen)
    assert got_weights.dtype == weights.dtype and torch.equal(got_weights, weights)


def _layer(experts: int, hidden: int, width: int, shared: int, seed: int) -> LayerWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    return LayerWeights(
        attn_norm=None,
        qkv=None,
        qkv_bias=None,
        o=None,
        o_bias=None,
        mlp_norm=None,
        gate_up=rand(2 * shared, hidden) if shared else None,
        down=rand(hidden, shared) if shared else None,
        q_norm=None,
        k_norm=None,
        router=rand(experts, hidden),
        experts_gate_up=rand(experts, 2 * width, hidden),
        experts_down=rand(experts, hidden, width),
        shared_gate=rand(1, hidden) if shared else None,
    )


@pytest.mark.parametrize("shared", [0, 24])
def test_expert_paths_agree(shared):
    """The grouped matmul (sorted fixed-shape rows) and the dense formulation (every
    expert on every token) equal the reference loop, an expert no token chose included;
    the op returns each token's chosen experts."""
    spec = MoESpec(experts=6, top_k=2, intermediate=16, layers=(True,), norm_topk=True)
    layer = _layer(6, 32, 16, shared, seed=1)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layer.router[5] = -50.0 * x.mean(0)  # expert 5: chosen by no token
        ref, chosen = moe_mlp(x, layer, spec, _act, "reference")
        assert chosen.shape == (11, 2) and 5 not in chosen.tolist()
        for path in EXPERT_PATHS:
            out, same = moe_mlp(x, layer, spec, _act, path)
            assert torch.equal(same, chosen), path
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=path)


def test_moe_specs_are_read_from_the_configs():
    q2, q3, mx = (spec_of(family_config(f)).moe for f in MOE_FAMILIES)
    assert q2.layers == (True, False, True)  # mlp_only_layers=[1]
    assert (q2.shared, q2.shared_gate, q2.norm_topk, q2.intermediate) == (80, True, False, 48)
    assert q3.layers == (False, True) and q3.norm_topk and q3.shared == 0  # sparse step 2
    assert mx.layers == (True, True) and mx.norm_topk and mx.weights_in_float
    assert (mx.experts, mx.top_k, mx.intermediate) == (8, 2, 64)
    assert spec_of(family_config("qwen2_moe")).qkv_bias
    assert spec_of(family_config("qwen3_moe")).qk_norm


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(root / "tok", vocab_size=320))
    dirs = {}
    for family in MOE_FAMILIES:
        family_model(family).save_pretrained(root / family)  # one tensor per expert
        tokenizer.save_pretrained(root / family)
        dirs[family] = str(root / family)
    return dirs


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpoints_on_disk_load_per_expert(moe_dirs, family):
    from safetensors import safe_open

    with safe_open(f"{moe_dirs[family]}/model.safetensors", framework="pt") as f:
        names = list(f.keys())
    assert any(".experts.0." in n for n in names) and not any("gate_up_proj" in n for n in names)
    engine = NativeRolloutEngine(model_path=moe_dirs[family], **ONE)
    ref = NativeRolloutEngine(model=family_model(family), **ONE)
    for got, want in zip(outputs(engine), outputs(ref), strict=True):
        assert torch.equal(got, want)
    partial = {n: t for n, t in family_model(family).state_dict().items() if "experts" not in n}
    empty = NativeRolloutEngine(model_path=moe_dirs[family], load_weights=False, **ONE)
    empty.update_weights(partial.items())
    assert empty.weights_unset == sum(spec_of(family_config(family)).moe.layers) * 2


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_weights_change_with_samples_in_flight(family):
    """An update (transformers' fused 3-D expert tensors) between steps: the tokens
    after it are what transformers' new model computes on the KV cache kept."""
    old = family_model(family)
    new = family_model(family, seed=9)
    engine = NativeRolloutEngine(model=old, **ONE)
    prompt = np.asarray(PROMPTS[2], dtype=np.int64)
    greedy = SamplingParams(n=1, max_new_tokens=10, do_sample=False, ignore_eos=True)
    (sample,) = engine.add(prompt, np.zeros(1, dtype=np.int64), np.full(1, 10), greedy).tolist()
    for _ in range(5):
        engine.step()
    engine.drain()
    cut = len(engine.output(sample).tokens)
    assert 0 < cut < 10
    engine.update_weights(new.state_dict().items(), version=3)
    while engine.busy:
        for done, _ in engine.step():
            out = engine.output(done)
    tokens = prompt.tolist() + out.tokens.tolist()
    cached = len(prompt) + cut - 1
    with torch.no_grad():
        past = old(input_ids=torch.tensor([tokens[:cached]]), use_cache=True)
        kept = new(
            input_ids=torch.tensor([tokens[cached:-1]]), past_key_values=past.past_key_values
        )
    assert kept.logits[0].argmax(-1).tolist() == out.tokens[cut:].tolist()
    assert out.versions[cut:].tolist() == [3] * (10 - cut)
    engine.release(np.asarray([sample]))


def test_tp2_matches_one_rank(moe_dirs, tmp_path):
    """TP=2 (gloo): each rank holds half of every expert's width (and of the shared
    expert's); from files, after whole updates, and from an FSDP2 trainer's sharded
    stream, its tokens and log-probs equal one rank's."""
    mp.spawn(moe_tp_worker, args=(str(tmp_path / "init"), moe_dirs, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    refs = {}
    for family in MOE_FAMILIES:
        refs[family] = outputs(NativeRolloutEngine(model_path=moe_dirs[family], **ONE))
    for family in ("qwen3_moe", "mixtral"):
        b = NativeRolloutEngine(model=family_model(family, seed=2), **ONE)
        refs[f"{family}_b"] = outputs(b)
    refs["stream"] = refs["qwen2_moe"]
    for key, (tokens, log_probs) in refs.items():
        for rank in ranks:
            assert torch.equal(rank[key][0], tokens), key
            torch.testing.assert_close(rank[key][1], log_probs, atol=1e-4, rtol=1e-4)
    assert not torch.equal(refs["mixtral"][0], refs["mixtral_b"][0])  # the update shows
    assert ranks[0]["stream_count"] == len(family_model("qwen2_moe").state_dict())


def test_tp_parts_of_expert_tensors():
    spec = spec_of(family_config("qwen2_moe"))
    last = TPShard(spec, 2, 1)
    p = "model.layers.0.mlp."
    assert last.part(p + "experts.gate_proj") == Part(1, 24, 48, 48)  # of gate_up_proj
    assert last.part(p + "experts.down_proj") == Part(2, 24, 48, 48)
    assert last.part(p + "experts.3.up_proj.weight") == Part(0, 24, 48, 48)
    assert last.part(p + "experts.3.down_proj.weight") == Part(1, 24, 48, 48)
    assert last.part(p + "shared_expert.gate_proj.weight") == Part(0, 40, 80, 80)
    assert last.part("model.layers.1.mlp.down_proj.weight") == Part(1, 64, 128, 128)
    for name in ("gate.weight", "shared_expert_gate.weight", "experts.gate_up_proj"):
        assert last.part(p + name) is None  # whole (gate_up_proj: split after, on load)
    mixtral = TPShard(spec_of(family_config("mixtral")), 2, 0)
    assert mixtral.part(p.replace("mlp", "block_sparse_moe") + "experts.7.w2.weight") == Part(
        1, 0, 32, 64
    )
    local = last.local_spec().moe
    assert (local.intermediate, local.shared) == (24, 40)
    # what the sharded stream sends of a 3-D down_proj (FSDP2 shards the experts)
    whole = torch.arange(4 * 64 * 48).view(4, 64, 48)
    for world in (2, 3):
        pieces = []
        for s in range(world):
            r0, r1 = _rows_held(4, world, s)
            rows, cut, shape = _piece(p + "experts.down_proj", whole.shape, (r0, r1), last)
            piece = whole[r0:r1][rows[0] : rows[1]].narrow(cut.dim, cut.start, 24)
            assert list(piece.shape) == shape
            pieces.append(piece)
        assert torch.equal(torch.cat(pieces), whole[:, :, 24:])


def test_unsupported_moe_configs_and_sizes_are_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5 of 4 experts"):
        spec_of(family_config("qwen3_moe", num_experts_per_tok=5))
    with pytest.raises(ValueError, match="does not divide the expert width 50"):
        check_tp_size(spec_of(family_config("qwen3_moe", moe_intermediate_size=50)), 4)
    spec = spec_of(family_config("qwen2_moe", shared_expert_intermediate_size=81))
    with pytest.raises(ValueError, match="shared expert width 81"):
        check_tp_size(spec, 2)


def test_the_transformers_version_fuses_experts_in_memory():
    """The layout the engine's names follow: transformers 5 holds each layer's experts
    as two 3-D tensors (a checkpoint's per-expert tensors are aliases of them)."""
    model = AutoModelForCausalLM.from_config(family_config("mixtral"))
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if "layers.0.mlp" in n}
    assert shapes == {
        "model.layers.0.mlp.gate.weight": (8, 64),
        "model.layers.0.mlp.experts.gate_up_proj": (8, 128, 64),
        "model.layers.0.mlp.experts.down_proj": (8, 64, 64),
    }, transformers.__version__


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_on_cuda_in_graphs_match_transformers(moe_dirs, family):
    """bf16 on CUDA: the experts run grouped (or dense where the grouped matmul does
    not), decode steps replay CUDA graphs, and the greedy tokens' log-probs are those of
    transformers' own bf16 forward over prompt and response (bf16's rounding apart)."""
    from family_cases import GREEDY, PROMPTS

    engine = NativeRolloutEngine(model_path=moe_dirs[family], device="cuda", max_num_seqs=8)
    paths = engine.runner.model.experts
    assert paths in ("grouped", "dense"), paths
    out = engine.generate_token_ids(PROMPTS, GREEDY)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.captures > 0  # decode ran in CUDA graphs
    model = AutoModelForCausalLM.from_pretrained(moe_dirs[family], dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    gaps = []
    for prompt, tokens, log_probs in zip(PROMPTS, out.tokens, out.log_probs, strict=True):
        response = [int(t) for t in tokens]
        ids = torch.tensor([prompt + response], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        picked = logits.log_softmax(-1)[torch.arange(len(response)), response].cpu()
        gaps.append((picked - torch.as_tensor(log_probs).float()).abs())
    gaps = torch.cat(gaps)
    # bf16 may flip a near-tied routing choice (a token or two routed elsewhere, as
    # rollout and training can differ): nearly every token within bf16's rounding
    close = (gaps < 0.1).float().mean().item()
    assert close >= 0.9 and gaps.median() < 0.03, (close, gaps.tolist(), paths)


def test_every_expert_path_runs_every_expert_a_token_chose():
    """Each token routed to every expert (top-k = experts, the last one included): the
    grouped and dense paths equal the reference loop."""
    spec = MoESpec(experts=4, top_k=4, intermediate=16, layers=(True,), norm_topk=False)
    layer = _layer(4, 32, 16, 0, seed=3)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, chosen = moe_mlp(x, layer, spec, _act, "reference")
        assert all(sorted(row) == [0, 1, 2, 3] for row in chosen.tolist())
        for path in EXPERT_PATHS:
            out, _ = moe_mlp(x, layer, spec, _act, path)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=path)


@pytest.mark.parametrize(
    "changes",
    [dict(norm_topk_prob=False), dict(num_experts_per_tok=4)],
    ids=["top2-not-renormalised", "top-k-every-expert"],
)
def test_qwen3_moe_routing_options_match_transformers(changes):
    """Qwen3-MoE's routing as its config sets it: without renormalising the top-k
    probabilities, and with every expert chosen (top-k = experts, allowed): the engine's
    greedy tokens are transformers' argmax and its log-probs transformers'."""
    model = family_model("qwen3_moe", **changes)
    out = NativeRolloutEngine(model=model, **ONE).generate_token_ids(PROMPTS, GREEDY)
    for prompt, tokens, log_probs in zip(PROMPTS, out.tokens, out.log_probs, strict=True):
        ids = torch.tensor([list(prompt) + tokens.tolist()])
        with torch.no_grad():
            want = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        assert tokens.tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(
            log_probs, want.gather(-1, tokens[:, None])[:, 0], atol=1e-4, rtol=1e-4
        )

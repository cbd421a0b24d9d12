"""Tensor-parallel native rollout: TP=2 on two real processes (gloo) against one unsplit engine.

One spawn runs every case (processes are slow to start on a loaded machine): a tiny
Qwen2 (KV heads split, tied embeddings) greedy, sampled at temperature 1 and with
top-k + top-p; a small Qwen3-shaped model (hidden 256, 4 layers, 8 heads, 2 KV heads,
an odd vocabulary split unevenly) greedy and sampled; a Llama with one KV head (replicated on both ranks,
attention biases, untied head) built from an HF module; weight updates with whole
tensors and through the sharded stream from an FSDP2 training engine; and a call whose
prompts differ between the ranks. The parent runs the same at TP=1 and compares.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

from native_toys import perturbed
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import NativeRolloutEngine
from rayrl.rollout.native.shards import Part, TPShard, check_tp_size
from rayrl.rollout.native.spec import ModelSpec
from rayrl.rollout.native.tp import ReplicaLayout, make_tp_groups
from rayrl.rollout.native.tp_weights import _piece, _rows_held
from tp_cases import CASES, CASES_OF, SMALL, outputs, tp_worker

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=320)


def _save(model, path, tokenizer) -> str:
    perturbed(model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    dirs = {}
    for key, seed in (("tiny", 0), ("tiny_b", 1)):
        path = build_tiny_model(root / key, **TINY)
        model = AutoModelForCausalLM.from_pretrained(path)
        perturbed(model, seed).save_pretrained(path)
        dirs[key] = str(path)
    tokenizer = AutoTokenizer.from_pretrained(dirs["tiny"])
    common = dict(max_position_embeddings=256, tie_word_embeddings=False)
    qwen3 = Qwen3Config(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=512,
        vocab_size=333,
        **common,
    )
    llama = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=320,
        attention_bias=True,
        **common,
    )
    for key, config in (("qwen3", qwen3), ("llama_mqa", llama)):
        torch.manual_seed(0)
        dirs[key] = _save(AutoModelForCausalLM.from_config(config), root / key, tokenizer)
    return dirs


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_run")
    mp.spawn(tp_worker, args=(str(out / "init"), model_dirs, str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _one_rank(path: str, cases=CASES) -> dict:
    return outputs(NativeRolloutEngine(model_path=path, **SMALL), cases)


def _assert_same(got: dict, ref: dict) -> None:
    for case, (tokens, lengths, log_probs) in ref.items():
        assert torch.equal(got[case][0], tokens), case  # token for token
        assert torch.equal(got[case][1], lengths), case
        torch.testing.assert_close(got[case][2], log_probs, atol=1e-4, rtol=1e-4, msg=case)


@pytest.mark.slow
def test_tp2_matches_one_rank(two_ranks, model_dirs):
    rank0, rank1 = two_ranks
    assert [(r["replica"], r["tp_rank"]) for r in two_ranks] == [(0, 0), (0, 1)]
    for key, cases in CASES_OF.items():
        ref = _one_rank(model_dirs[key], {k: CASES[k] for k in cases})
        _assert_same(rank0[key], ref)
        for case in ref:  # both ranks return the very same output
            pairs = zip(rank0[key][case], rank1[key][case], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), (key, case)
    # each rank caches only its KV heads: 1 of 2 (tiny, qwen3); the one KV head (llama)
    assert [rank0[k + "_kv_heads"] for k in ("tiny", "qwen3", "llama_mqa")] == [1, 1, 1]
    assert rank0["qwen3"]["sampled"][0].shape[0] == 10  # 5 prompts x n=2


@pytest.mark.slow
def test_tp2_weight_updates_whole_and_sharded(two_ranks, model_dirs):
    ref = _one_rank(model_dirs["tiny_b"], {"greedy": CASES["greedy"]})
    before = _one_rank(model_dirs["tiny"], {"greedy": CASES["greedy"]})
    assert not torch.equal(ref["greedy"][0], before["greedy"][0])  # the update shows
    params = len(load_file(f"{model_dirs['tiny_b']}/model.safetensors"))
    for rank in two_ranks:
        _assert_same(rank["update_whole"], ref)
        _assert_same(rank["update_sharded"], ref)
        assert rank["update_sharded_count"] == params


@pytest.mark.slow
def test_tp2_ranks_given_other_prompts_fail_clearly(two_ranks):
    for rank in two_ranks:
        assert "TP ranks [1] got other prompts or sampling" in rank["mismatch_error"]


# ---------------------------------------------------------------- no processes
def _spec(**changes) -> ModelSpec:
    base = dict(
        model_type="qwen2",
        layers=2,
        hidden=64,
        heads=8,
        kv_heads=2,
        head_dim=8,
        intermediate=96,
        vocab=101,
        rms_eps=1e-6,
        qkv_bias=True,
        o_bias=False,
        qk_norm=False,
        tie_embeddings=True,
        max_positions=64,
    )
    return ModelSpec(**{**base, **changes})


def test_shard_parts_split_heads_kv_heads_mlp_and_vocabulary():
    spec = _spec()
    last = TPShard(spec, 4, 3)  # 4 ranks > 2 KV heads: KV head 1 on ranks 2 and 3
    assert (last.heads, last.kv_heads, last.kv_first, last.intermediate) == (2, 1, 1, 24)
    assert last.vocab_rows == (78, 101)  # ceil(101 / 4) = 26 rows a rank, 23 on the last
    p = "model.layers.1."
    assert last.part(p + "self_attn.q_proj.weight") == Part(0, 48, 64, 64)
    assert last.part(p + "self_attn.k_proj.bias") == Part(0, 8, 16, 16)
    assert last.part(p + "self_attn.o_proj.weight") == Part(1, 48, 64, 64)
    assert last.part(p + "mlp.up_proj.weight") == Part(0, 72, 96, 96)
    assert last.part(p + "mlp.down_proj.weight") == Part(1, 72, 96, 96)
    assert last.part("lm_head.weight") == Part(0, 78, 101, 101)
    assert last.part(p + "input_layernorm.weight") is None
    local = last.local_spec()
    assert (local.heads, local.kv_heads, local.intermediate, local.vocab) == (2, 1, 24, 23)
    assert TPShard(spec, 2, 1).kv_first == 1  # 2 ranks: one KV head each
    assert TPShard(spec, 1, 0).local_spec() is spec
    whole = torch.arange(64 * 64).view(64, 64)
    assert torch.equal(last.take(p + "self_attn.o_proj.weight", whole), whole[:, 48:])


def test_sizes_that_cannot_split_the_model_are_refused():
    with pytest.raises(ValueError, match="does not divide the 8 attention heads"):
        check_tp_size(_spec(), 3)
    with pytest.raises(ValueError, match="neither divides the 3 KV heads"):
        check_tp_size(_spec(heads=12, kv_heads=3, intermediate=96), 2)
    with pytest.raises(ValueError, match="MLP width 90"):
        check_tp_size(_spec(intermediate=90), 4)


def test_replica_layout_and_one_rank_groups():
    layout = ReplicaLayout(world_size=8, tp_size=4)
    assert layout.replicas == 2 and layout.leaders == [0, 4]
    assert layout.ranks(1) == [4, 5, 6, 7] and layout.replica_of(5) == 1
    assert layout.tp_rank(6) == 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 must .* divide"):
        ReplicaLayout(world_size=8, tp_size=3)
    one = make_tp_groups(1, 1)  # no torch.distributed needed, nothing created
    assert one.group is None and (one.replica, one.tp_rank) == (0, 0)
    with pytest.raises(RuntimeError, match="form the worker group's process group first"):
        make_tp_groups(2, 2)


def test_engine_refuses_tp_without_a_group():
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="tp_size=2 needs tp_group="):
        NativeRolloutEngine(model=model, tp_size=2, **SMALL)


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (3, 1), (4, 2), (8, 4)])
def test_sharded_stream_pieces_make_each_rank_its_part(world, tp):
    # What `tp_rollout_weights` sends: FSDP rank s's rows of a tensor, cut for the TP rank
    # of a destination; the pieces from every s, in order, must be that TP rank's part.
    spec = _spec(vocab=37)  # FSDP chunks and TP parts fall on different rows
    names = {
        "model.embed_tokens.weight": (37, 64),
        "model.layers.0.self_attn.k_proj.weight": (16, 64),
        "model.layers.0.self_attn.q_proj.bias": (64,),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
        "model.layers.0.post_attention_layernorm.weight": (64,),
    }
    for name, shape in names.items():
        whole = torch.arange(torch.Size(shape).numel()).view(shape)
        for t in range(tp):
            shard = TPShard(spec, tp, t)
            pieces = []
            for s in range(world):
                r0, r1 = _rows_held(shape[0], world, s)
                rows, cut, piece_shape = _piece(name, whole.shape, (r0, r1), shard)
                piece = whole[r0:r1][rows[0] : rows[1]]
                if cut is not None:
                    piece = piece.narrow(cut.dim, cut.start, cut.stop - cut.start)
                assert list(piece.shape) == piece_shape, (name, s)
                pieces.append(piece)
            assert torch.equal(torch.cat(pieces), shard.take(name, whole)), (name, t)

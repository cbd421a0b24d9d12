"""Shared prompts: GRPO's samples of a prompt trained with the prompt run once give the
rows' own log-probs, entropy and gradients (`rayrl.train.shared_prompts`)."""

from __future__ import annotations

import pytest
import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.train.attention import SHARED_KV_INDEX, packed_attention_kwargs
from rayrl.train.engine import TrainEngine
from rayrl.train.outputs import response_outputs
from rayrl.train.shared_prompts import share_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def grouped_batch(prompts: list[int], samples: int, response_lens: list[int], seed: int = 0):
    """``len(prompts)`` prompts of the given real lengths, each followed by ``samples``
    responses (lengths from ``response_lens``, cycled); `ragged_batch`'s layout, each
    group's rows given its first row's prompt; the samples of a prompt adjacent, then
    one more row sharing prompt 0 at the end (a group need not be adjacent)."""
    order = [i for i in range(len(prompts)) for _ in range(samples)] + [0]
    lengths = [(prompts[i], response_lens[k % len(response_lens)]) for k, i in enumerate(order)]
    width = max(prompts)
    batch = ragged_batch(len(order), width, max(response_lens), seed, lengths)
    ids = batch["input_ids"]
    for k, i in enumerate(order):
        ids[k, :width] = ids[order.index(i), :width]
    return batch


def test_each_prompt_is_packed_once_with_its_rows_responses():
    batch = grouped_batch([5, 3], samples=3, response_lens=[4, 2, 6])
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    packed = share_prompts(ids, mask, pos, response_len=6)
    assert packed.rows_per_prompt == [4, 3]  # prompt 0's three samples and the last row
    responses = mask[:, 5:].sum(1).tolist()
    assert packed.tokens == 5 + 3 + sum(responses)
    assert packed.q_lengths == [5, *responses[:3], responses[6], 3, *responses[3:6]]
    assert packed.k_lengths == [5, *(5 + n for n in responses[:3]), 5 + responses[6], 3] + [
        3 + n for n in responses[3:6]
    ]
    # a response's positions go on from its prompt's
    row = packed.position_ids[0]
    assert row[:5].tolist() == [0, 1, 2, 3, 4] and row[5 : 5 + responses[0]].tolist() == list(
        range(5, 5 + responses[0])
    )
    # every response's first token is predicted at its prompt's last token
    first = packed.response.logit_index.tolist()
    assert first[0] == 4 and packed.response.labels[0] == ids[0, 5]
    assert packed.kv_index[: 5 + 5 + responses[0]].tolist() == list(range(5)) + list(
        range(5)
    ) + list(range(5, 5 + responses[0]))


def test_rows_without_a_shared_prompt_are_left_to_plain_packing():
    batch = grouped_batch([4, 4, 2], samples=1, response_lens=[3])
    ids = batch["input_ids"].clone()
    ids[-1, 3] = ids[0, 3] + 1  # the last row's prompt differs from prompt 0's by a token
    mask, pos = batch["attention_mask"], batch["position_ids"]
    assert share_prompts(ids, mask, pos, response_len=3) is None


def test_packed_attention_kwargs_carry_each_segments_keys():
    kw = packed_attention_kwargs([2, 3], torch.device("cpu"), keys=([2, 5], torch.arange(7)))
    assert kw["cu_seq_lens_q"].tolist() == [0, 2, 5] and kw["cu_seq_lens_k"].tolist() == [0, 2, 7]
    assert (kw["max_length_q"], kw["max_length_k"]) == (3, 5)
    assert kw[SHARED_KV_INDEX].tolist() == list(range(7))
    assert SHARED_KV_INDEX not in packed_attention_kwargs([2, 3], torch.device("cpu"))


def _engine(model_dir, share: bool) -> TrainEngine:
    return TrainEngine(model_dir, optim={"lr": 1e-3}, share_prompts=share, seed=0)


def _loss(outputs, micro):
    """The micro-batch's share of the mini-batch's token mean (the loss contract), so
    any split into micro-batches gives the same loss."""
    mask, total = micro["response_mask"].float(), micro.meta["global_token_count"]
    loss = -(outputs["log_probs"] * mask).sum() / total
    return loss, {"entropy": (outputs["entropy"] * mask).sum().detach() / total}


@pytest.mark.parametrize(
    "sizes",
    [{"micro_batch_size": 4}, {"micro_batch_size": 13}, {"max_tokens_per_micro_batch": 40}],
)
def test_shared_prompts_give_the_rows_own_outputs_and_loss(tiny_model_dir, sizes):  # noqa: F811
    batch = grouped_batch([6, 1, 9], samples=4, response_lens=[5, 1, 8, 3], seed=1)
    plain, shared = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    for key in ("log_probs", "entropy"):
        want = plain.forward(batch, with_entropy=True, **sizes)[key]
        got = shared.forward(batch, with_entropy=True, **sizes)[key]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    a = plain.train_step(batch, _loss, with_entropy=True, **sizes)
    b = shared.train_step(batch, _loss, with_entropy=True, **sizes)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_the_shared_prompts_gradient_is_the_sum_of_the_rows(tiny_model_dir):  # noqa: F811
    """Every parameter's gradient, the shared prompt's path included (the embedding of
    its tokens gets each row's share)."""
    batch = grouped_batch([6, 2], samples=3, response_lens=[5, 1, 8], seed=2)
    model = _engine(tiny_model_dir, False).model

    def grads(share: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = response_outputs(model, batch, packed=True, with_entropy=True, share_prompts=share)
        mask = batch["response_mask"].float()
        ((out["log_probs"] + 0.1 * out["entropy"]) * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want, got = grads(False), grads(True)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_setting_auto_shares_on_cuda_only_and_others_are_refused():
    from rayrl.train.shared_prompts import share_prompts_on

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert share_prompts_on("auto", cuda) and not share_prompts_on("auto", cpu)
    assert share_prompts_on(True, cpu) and not share_prompts_on(False, cuda)
    assert share_prompts_on(True, cpu, "eager")  # loaded as rayrl's varlen attention
    assert not share_prompts_on(True, cuda, "flash_attention_2")  # cannot read the keys
    with pytest.raises(ValueError, match="true, false or auto.*model.share_prompts"):
        share_prompts_on("yes please", cpu)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_prompts_on_cuda_match_the_rows_own(tiny_model_dir, compiled):  # noqa: F811
    """bf16 on CUDA: one flash call over the packed row with each segment's keys (its
    causal window aligned to the keys' end), compiled layers or not."""
    batch = grouped_batch([30, 7, 51], samples=8, response_lens=[20, 3, 41, 9], seed=3)

    def engine(share: bool) -> TrainEngine:
        return TrainEngine(
            tiny_model_dir,
            optim={"lr": 1e-3},
            device="cuda",
            share_prompts=share,
            torch_compile=compiled,
        )

    plain, shared = engine(False), engine(True)
    assert shared.share_prompts
    for key in ("log_probs", "entropy"):
        want = plain.forward(batch, micro_batch_size=12, with_entropy=True)[key]
        got = shared.forward(batch, micro_batch_size=12, with_entropy=True)[key]
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        # and not by chance: another row's prompt gives other log-probs
        assert (got - want).abs().mean() < 0.1 * want.abs().mean()
    a = plain.train_step(batch, _loss, micro_batch_size=12, with_entropy=True)
    b = shared.train_step(batch, _loss, micro_batch_size=12, with_entropy=True)
    assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)


def test_the_flop_count_runs_each_shared_prompt_once(tiny_model_dir):  # noqa: F811
    from rayrl.train.shared_prompts import repeated_prompt_tokens

    batch = grouped_batch([6, 2], samples=3, response_lens=[5, 1, 8], seed=2)
    # prompt 0: 4 rows of 6 tokens, prompt 1: 3 rows of 2 tokens
    assert repeated_prompt_tokens(batch, 8) == 3 * 6 + 2 * 2
    plain, shared = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    saved = plain.train_flops(batch) - shared.train_flops(batch)
    assert saved == pytest.approx(6.0 * plain.flop_model.body_params * (3 * 6 + 2 * 2))


def test_a_critics_values_with_shared_prompts_are_the_rows_own(tiny_model_dir):  # noqa: F811
    """The value head reads the same positions: the prompt's last token for a
    response's first value."""
    batch = grouped_batch([6, 3], samples=3, response_lens=[5, 1, 8], seed=4)

    def values(share: bool) -> torch.Tensor:
        engine = TrainEngine(tiny_model_dir, value_head=True, share_prompts=share, seed=0)
        return engine.forward(batch, micro_batch_size=7)["values"]

    torch.testing.assert_close(values(True), values(False), atol=2e-5, rtol=1e-5)


def test_shared_prompts_through_a_lora_model(tiny_model_dir):  # noqa: F811
    """peft's wrapper passes the attention's keywords on to the model it wraps."""
    batch = grouped_batch([5, 2], samples=3, response_lens=[4, 7], seed=5)
    from rayrl.train.lora import LoraSpec

    lora = LoraSpec(lora_rank=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))

    def log_probs(share: bool) -> torch.Tensor:
        engine = TrainEngine(tiny_model_dir, lora=lora, share_prompts=share, seed=0)
        return engine.forward(batch, micro_batch_size=8)["log_probs"]

    torch.testing.assert_close(log_probs(True), log_probs(False), atol=2e-5, rtol=1e-5)

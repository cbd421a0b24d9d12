"""Routing replay in training (`rayrl.train.router_replay`), on CPU with tiny random
mixtures of experts (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral).

A replayed block runs exactly the experts it is given, weighted from its router's own
logits (gradients reach the router); replaying the model's own routing changes no bit
in any layout (padded, packed, shared prompts); a perturbed record changes the
log-probs from the first perturbed token on and shows in the counts; the backward's
recomputation under activation checkpointing replays the same experts; and the
rollout's record from a bf16 native engine, replayed, takes the routing mismatch to 0
and the rollout-vs-actor probability gap down.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from family_cases import MOE_FAMILIES, PROMPTS, SMALL, family_model
from rayrl.algos.probs_diff import probs_diff_metrics, probs_diff_rows
from rayrl.algos.routing import (
    ACTOR_ROUTES,
    ROUTES,
    ROUTING_COLUMNS,
    as_index,
    routing_metrics,
    unrouted,
)
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.train.engine import TrainEngine
from rayrl.train.router_replay import RoutingPass, moe_routers, routing
from test_routing_record import prompt_batch, transformers_routing

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SAMPLED = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=3)
LAYOUTS = {  # TrainEngine options of each layout of the model's input
    "padded": dict(use_remove_padding=False),
    "packed": dict(use_remove_padding=True),
    "shared": dict(use_remove_padding=True, share_prompts=True),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import AutoTokenizer

    from rayrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("replay")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(root / "tok", vocab_size=320))
    for family in MOE_FAMILIES:
        family_model(family).save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)  # the native engine's
    return {family: str(root / family) for family in MOE_FAMILIES}


def rollout(path: str, dtype: str = "float32"):
    """Two samples of each prompt from the native engine, with its routing record."""
    engine = NativeRolloutEngine(
        model_path=path, dtype=dtype, record_routes=True, **SMALL, max_model_len=64
    )
    return engine.generate(prompt_batch(PROMPTS), SAMPLED)


def forward(engine: TrainEngine, batch, plan: RoutingPass | None):
    with routing(engine.model, plan):
        return engine.forward(batch, micro_batch_size=3)


def by_hand(block, x: torch.Tensor, experts: torch.Tensor, family: str) -> torch.Tensor:
    """The block's output with each token routed to ``experts`` [T, k], written out:
    weights from the router's softmax (renormalised as the family does), each chosen
    expert's SwiGLU scaled by its weight and summed, plus Qwen2-MoE's gated shared expert."""
    router, bank = block.gate, block.experts
    probs = F.linear(x, router.weight).float().softmax(-1)
    weights = probs.gather(-1, experts)
    if family == "mixtral" or router.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(experts[t].tolist()):
            gate, up = F.linear(x[t], bank.gate_up_proj[e]).chunk(2)
            out[t] += F.linear(bank.act_fn(gate) * up, bank.down_proj[e]) * weights[t, slot]
    if hasattr(block, "shared_expert"):
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_replayed_block_runs_exactly_the_given_experts(family):
    """Given experts (the router's worst choices, say) for most tokens, none for two:
    the block's output and its router's gradient are the written-out computation's,
    the two tokens without a record keeping the router's own top-k."""
    model = family_model(family).float()
    routers = moe_routers(model)
    block = next(m for m in model.modules() if getattr(m, "gate", None) is routers[-1])
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    k = routers[-1].top_k
    with torch.no_grad():
        probs = F.linear(x, routers[-1].weight).softmax(-1)
    worst = probs.topk(k, dim=-1, largest=False).indices  # never what the router picks
    routes = torch.full((1, 7, len(routers), k), unrouted(torch.uint8), dtype=torch.uint8)
    routes[0, :5, -1] = worst[:5].to(torch.uint8)
    want = torch.cat([worst[:5], probs.topk(k, dim=-1).indices[5:]])
    with routing(model, RoutingPass(replay=True)) as replay:
        replay.feed({ROUTES: routes}, torch.arange(7).view(1, 7), 7, torch.device("cpu"))
        got = block(x.view(1, 7, -1)).view(7, -1)
        got.square().sum().backward()
    replayed_grad = routers[-1].weight.grad.clone()
    routers[-1].weight.grad = None
    reference = by_hand(block, x, want, family)
    reference.square().sum().backward()
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    assert replayed_grad.abs().sum() > 0  # the weights are the router's: it learns
    scale = float(routers[-1].weight.grad.abs().max())  # sums of terms this large
    torch.testing.assert_close(replayed_grad, routers[-1].weight.grad, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replaying_its_own_routing_changes_no_bit(model_dirs, layout):
    """R2's two passes: the log-prob pass records the router's own choices (transformers'
    routing at every real position, unrouted on padding); the update replaying them
    computes the very same log-probs."""
    family = "qwen2_moe"
    engine = TrainEngine(model_dirs[family], **LAYOUTS[layout])
    batch = rollout(model_dirs[family])
    plain = forward(engine, batch, None)
    recorded = forward(engine, batch, RoutingPass(record=True))
    assert torch.equal(recorded["log_probs"], plain["log_probs"])
    own, mask = recorded[ACTOR_ROUTES], batch["attention_mask"].bool()
    assert bool((own[~mask] == unrouted(own.dtype)).all())
    for row in (0, 5):
        want = transformers_routing(engine.model, batch["input_ids"][row][mask[row]].tolist())
        assert torch.equal(as_index(own[row][mask[row]]), want)
    batch = batch.select("input_ids", "attention_mask", "position_ids", "responses")
    batch[ROUTES] = own
    replayed = forward(engine, batch, RoutingPass(replay=True, compare=True))
    assert torch.equal(replayed["log_probs"], plain["log_probs"])
    metrics = routing_metrics({k: replayed[k] for k in ROUTING_COLUMNS})
    assert metrics == {
        "actor/routing_mismatch_frac": 0.0,
        "actor/router_disagree_frac": 0.0,
        "actor/routing_recorded_frac": 1.0,
    }


def swapped(routes: torch.Tensor, row: int, column: int, experts: int) -> torch.Tensor:
    """``routes`` with one position's experts moved to others (each layer: e -> e+1)."""
    routes = routes.clone()
    routes[row, column] = (routes[row, column].long() + 1) % experts
    return routes


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_a_perturbed_record_changes_the_log_probs_and_the_counts(model_dirs, layout):
    """The check fails when the replayed experts are not the rollout's: swapping one
    response token's experts changes that row's log-probs from the next token on (and
    no other row's), and the router disagrees with the record there."""
    family = "mixtral"
    engine = TrainEngine(model_dirs[family], **LAYOUTS[layout])
    batch = rollout(model_dirs[family])
    plan = RoutingPass(replay=True, compare=True)
    honest = forward(engine, batch, plan)
    row, column, width = 3, batch["prompts"].shape[1] + 2, batch["prompts"].shape[1]
    batch[ROUTES] = swapped(batch[ROUTES], row, column, experts=8)
    bent = forward(engine, batch, plan)
    changed = (bent["log_probs"] != honest["log_probs"]).nonzero().tolist()
    assert changed and {r for r, _ in changed} == {row}
    assert min(c for _, c in changed) == column - width + 1  # the token it feeds on
    counts = {k: bent[k] - honest[k] for k in ROUTING_COLUMNS}
    assert counts["router_disagree"].tolist() == [2.0 if r == row else 0.0 for r in range(8)]
    assert not counts["routing_mismatch"].any()  # the forward used the record, as told
    metrics = routing_metrics({k: bent[k] for k in ROUTING_COLUMNS})
    assert metrics["actor/router_disagree_frac"] > 0


def test_checkpointed_backward_replays_the_same_experts(model_dirs):
    """Activation checkpointing recomputes each layer in the backward: with the record
    still fed, the step's weights equal those of the step without checkpointing."""
    family = "qwen3_moe"
    batch = rollout(model_dirs[family])
    batch[ROUTES] = swapped(batch[ROUTES], 1, batch["prompts"].shape[1] + 1, experts=4)

    def loss_fn(outputs, micro):
        mask = micro["response_mask"]
        return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}

    weights = []
    for checkpointing in (False, True):
        engine = TrainEngine(
            model_dirs[family], gradient_checkpointing=checkpointing, optim={"lr": 1e-2}
        )
        with routing(engine.model, RoutingPass(replay=True)):
            engine.train_step(batch, loss_fn, micro_batch_size=4)
        weights.append(dict(engine.model.named_parameters()))
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_replaying_a_bf16_rollout_takes_the_mismatch_to_zero_and_the_gap_down(model_dirs):
    """A bf16 native rollout routes some tokens elsewhere than the fp32 actor: without
    replay the counts show it and those tokens' probabilities drift; with the rollout's
    record replayed (R3) the actor uses its experts, and the gap shrinks."""
    family = "mixtral"
    engine = TrainEngine(model_dirs[family])
    batch = rollout(model_dirs[family], dtype="bfloat16")
    found = {}
    for name, plan in (("off", RoutingPass(compare=True)), ("R3", RoutingPass(True, False, True))):
        out = forward(engine, batch, plan)
        rows = probs_diff_rows(batch["rollout_log_probs"], out["log_probs"], batch["response_mask"])
        found[name] = {
            **routing_metrics({k: out[k] for k in ROUTING_COLUMNS}),
            **probs_diff_metrics(rows, batch["response_mask"].sum(-1)),
        }
    off, on = found["off"], found["R3"]
    assert off["actor/routing_mismatch_frac"] > 0.01 and on["actor/routing_mismatch_frac"] == 0
    assert off["actor/routing_recorded_frac"] == on["actor/routing_recorded_frac"] == 1.0
    for stat in ("mean", "max"):
        key = f"training/rollout_probs_diff_{stat}"
        assert on[key] < 0.8 * off[key], (stat, off[key], on[key])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_on_cuda_under_bf16_autocast(model_dirs):
    """On a GPU the actor computes in bf16 under autocast: replaying its own recorded
    routing changes no bit, and a swapped position changes its row's log-probs."""
    family = "qwen2_moe"
    engine = TrainEngine(model_dirs[family], device="cuda")
    assert engine.mixed_precision
    batch = rollout(model_dirs[family])
    plain = forward(engine, batch, None)
    own = forward(engine, batch, RoutingPass(record=True))[ACTOR_ROUTES]
    batch[ROUTES] = own
    replayed = forward(engine, batch, RoutingPass(replay=True))
    assert torch.equal(replayed["log_probs"], plain["log_probs"])
    batch[ROUTES] = swapped(own, 2, batch["prompts"].shape[1] + 1, experts=4)
    bent = forward(engine, batch, RoutingPass(replay=True))
    rows = {r for r, _ in (bent["log_probs"] != plain["log_probs"]).nonzero().tolist()}
    assert rows == {2}


def test_an_on_policy_update_counts_its_routing_as_the_log_prob_pass_would(model_dirs):
    """No separate log-prob pass: the update's own forward replays the rollout's record
    (R3) and counts against it, summed over micro-batches into the loss's metrics; the
    actor's metrics from those totals are the pass's."""
    from rayrl.config import load_config
    from rayrl.workers.losses import actor_loss_fn
    from rayrl.workers.routing import routing_from_totals, update_routing

    family = "qwen3_moe"
    cfg = load_config(
        "grpo",
        [
            f"actor_rollout_ref.model.path={model_dirs[family]}",
            "actor_rollout_ref.rollout.name=native",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "trainer.device=cpu",
        ],
    )
    engine = TrainEngine(model_dirs[family])
    batch = rollout(model_dirs[family], dtype="bfloat16")  # some routing differs
    batch[ROUTES] = swapped(batch[ROUTES], 0, batch["prompts"].shape[1], experts=4)
    separate = forward(engine, batch, RoutingPass(replay=True, compare=True))
    want = routing_metrics({k: separate[k] for k in ROUTING_COLUMNS})
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    loss_fn = actor_loss_fn(cfg.actor_rollout_ref.actor, on_policy=True)
    with update_routing(cfg, batch, engine.model, on_policy=True) as routed:
        metrics = engine.train_step(routed, loss_fn, micro_batch_size=3)
    assert routing_from_totals(metrics) == pytest.approx(want, rel=1e-12)
    assert want["actor/router_disagree_frac"] > 0 and want["actor/routing_mismatch_frac"] == 0
    assert not [key for key in metrics if key.startswith("routing/")]  # taken out

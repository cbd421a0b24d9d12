"""Routing replay for mixture-of-experts models: the training forward routes each token
to the experts a record gives, so that rollout and training run the same experts.

A transformers 5 mixture-of-experts block (Qwen2-MoE, Qwen3-MoE, Mixtral) asks its
router module (``block.gate``) for ``(logits, weights, experts)`` and runs the experts
it names. `RouterReplay` puts a forward hook on every such router of a model, in layer
order. Inside `routing(model, RoutingPass(...))` (outside it the hooks do nothing), each
forward of `rayrl.train.outputs.response_outputs` feeds the micro-batch's record
(``routed_experts``, `rayrl.algos.routing`), laid out as the model's input is (padded,
packed, or with shared prompts: `given_at`), and the hooks

- **replay** it: where a position has a record, the router's experts are replaced by the
  recorded ones, and their weights are computed again from the router's own logits, as
  the family computes them (softmax in float32, the chosen probabilities, renormalised
  where the family does, rounded to the logits' dtype but in Mixtral), so that the
  gradient still reaches the router; elsewhere the router's own choice stands;
- **record** the router's own choices (R2: recorded in the log-prob pass, replayed in
  the update), returned as ``actor_routed_experts`` in the record's layout;
- **compare** the experts used, and the router's own, with the record, per row
  (`rayrl.algos.routing.ROUTING_COLUMNS`).

A record stays fed until the next forward, so the recomputation of activation
checkpointing in the backward replays the same experts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rayrl.algos.routing import (
    ACTOR_ROUTES,
    ROUTES,
    ROUTING_COLUMNS,
    as_index,
    routes_dtype,
    routing_differs,
    unrouted,
)

if TYPE_CHECKING:
    from rayrl.batch import Batch

# a router's forward output: (logits, routing weights, chosen experts)
RouterOutput = tuple[Tensor, Tensor, Tensor]
RouterHook = Callable[[nn.Module, tuple[Any, ...], RouterOutput], RouterOutput | None]

__all__ = [
    "ROUTER_STYLES",
    "RouterReplay",
    "RoutingPass",
    "active_routing",
    "moe_routers",
    "routing",
]


@dataclass(frozen=True)
class RoutingPass:
    """What a pass does with the routing (module docstring)."""

    replay: bool = False  # route by the micro-batch's record where it has one
    record: bool = False  # output the router's own choices (`ACTOR_ROUTES`)
    compare: bool = False  # output per-row counts against the record (`ROUTING_COLUMNS`)


@dataclass(frozen=True)
class RouterStyle:
    """How a family's router turns its logits into the chosen experts' weights."""

    norm_attr: str | None  # the router's flag to renormalise the chosen probabilities
    weights_in_float: bool  # the weights stay float32 (Mixtral), else the logits' dtype

    def weights(self, router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        picked = probs.gather(-1, experts)
        if self.norm_attr is None or getattr(router, self.norm_attr):
            picked = picked / picked.sum(dim=-1, keepdim=True)
        return picked if self.weights_in_float else picked.to(logits.dtype)


# model_type -> its router's style (transformers' modeling_<family>.py)
ROUTER_STYLES = {
    "qwen2_moe": RouterStyle("norm_topk_prob", weights_in_float=False),
    "qwen3_moe": RouterStyle("norm_topk_prob", weights_in_float=False),
    "mixtral": RouterStyle(None, weights_in_float=True),
}


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router module of each mixture-of-experts block of ``model``, in layer order."""
    return [
        m.gate
        for m in model.modules()
        if isinstance(getattr(m, "gate", None), nn.Module)
        and hasattr(m, "experts")
        and hasattr(m.gate, "top_k")
    ]


class RouterReplay:
    """Hooks on a model's routers and what the current forward gives and gets them."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if self.routers and model_type not in ROUTER_STYLES:
            raise ValueError(
                f"routing replay runs the routers of {sorted(ROUTER_STYLES)}, not of "
                f"model_type={model_type!r}; turn actor_rollout_ref.actor.router_replay.mode "
                "and rollout.enable_rollout_routing_replay off for this model"
            )
        self.style = ROUTER_STYLES.get(model_type or "")
        self.experts = int(self.routers[0].num_experts) if self.routers else 0
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.plan: RoutingPass | None = None
        self.given: Tensor | None = None  # [tokens, layers, k] int64, -1: not recorded
        self.own: list[Tensor | None] = [None] * len(self.routers)
        self.used: list[Tensor | None] = [None] * len(self.routers)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> RouterHook:
        def hook(
            router: nn.Module, args: tuple[Any, ...], output: RouterOutput
        ) -> RouterOutput | None:
            plan = self.plan
            if plan is None:
                return None
            logits, weights, chosen = output
            self.own[layer] = self.used[layer] = chosen.detach()
            given = self.given
            if not plan.replay or given is None:
                return None
            want = given[:, layer]
            if want.shape != chosen.shape:
                raise RuntimeError(
                    f"routing replay: MoE layer {layer}'s router routed {tuple(chosen.shape)} "
                    f"(tokens, top-k) but the record gives {tuple(want.shape)}; the record "
                    "does not match this forward's tokens (a bug in rayrl, please report it)"
                )
            recorded = want[:, :1] >= 0
            experts = torch.where(recorded, want, chosen)
            assert self.style is not None  # routers without a style refused at __init__
            replayed = self.style.weights(router, logits, experts)
            self.used[layer] = experts.detach()
            return logits, torch.where(recorded, replayed, weights), experts

        return hook

    # ------------------------------------------------------------- a forward
    def feed(self, micro: Batch, where: Tensor, tokens: int, device: torch.device) -> None:
        """Before a forward of ``tokens`` positions: the micro-batch's record (if it has
        one and the pass replays or compares) laid out at ``where`` (`given_at`)."""
        self.own = [None] * len(self.routers)
        self.used = [None] * len(self.routers)
        self.given = None
        plan = self.plan
        if plan is None or not (plan.replay or plan.compare) or ROUTES not in micro:
            return
        routes = micro[ROUTES]
        if tuple(routes.shape[2:]) != (len(self.routers), self.top_k):
            raise ValueError(
                f"routing replay: the record has {routes.shape[2]} MoE layers of "
                f"{routes.shape[3]} experts per token, the actor's model has "
                f"{len(self.routers)} of top-{self.top_k}; rollout and actor must run the "
                "same model"
            )
        self.given = given_at(routes, where, tokens).to(device, non_blocking=True)

    def outputs(self, micro: Batch, where: Tensor) -> dict[str, Tensor]:
        """After the forward: the record of the router's own choices (``record``) and
        the per-row counts against the micro-batch's record (``compare``)."""
        plan = self.plan
        out: dict[str, Tensor] = {}
        chosen = [o for o in self.own if o is not None]
        if plan is None or not (plan.record or plan.compare) or len(chosen) != len(self.own):
            return out
        mask = micro["attention_mask"].bool()
        real = mask & (where >= 0)
        at = where.clamp(min=0).to(chosen[0].device)
        own = torch.stack(chosen, dim=1)[at]  # [b, S, layers, k]
        if plan.record:
            dtype = routes_dtype(self.experts)
            kept = own.to(dtype).cpu().masked_fill(~real[..., None, None], unrouted(dtype))
            out[ACTOR_ROUTES] = kept
        if plan.compare and ROUTES in micro:
            used = torch.stack([u for u in self.used if u is not None], dim=1)[at].cpu()
            out.update(_counts(as_index(micro[ROUTES]), own.cpu(), used, real))
        return out


def _counts(given: Tensor, own: Tensor, used: Tensor, real: Tensor) -> dict[str, Tensor]:
    """`ROUTING_COLUMNS` of each row (float64 ``[b]``), over its real positions but the
    last: that token's routing changes nothing trained (no later token attends to it,
    its logits predict nothing), and a rollout never feeds it back to record it."""
    after = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    real = real & after
    decided = real[..., None] & (given[..., 0] >= 0)  # [b, S, layers]
    values = (
        real.sum(1),
        (real & (given[..., 0, 0] >= 0)).sum(1),
        decided.sum((1, 2)),
        (decided & routing_differs(used, given)).sum((1, 2)),
        (decided & routing_differs(own, given)).sum((1, 2)),
    )
    return {k: v.double() for k, v in zip(ROUTING_COLUMNS, values, strict=True)}


def given_at(routes: Tensor, where: Tensor, tokens: int) -> Tensor:
    """A ``[rows, S, layers, k]`` record laid out at the model's ``tokens`` positions:
    ``where[row, col]`` is the position of that token in the model's input (-1: not
    run). Rows that share a position (a shared prompt) give it the first one's record;
    positions no row gives are -1 (the router chooses)."""
    rows, width, layers, k = routes.shape
    flat = as_index(routes).reshape(rows * width, layers, k)
    at = where.reshape(-1)
    ran = at >= 0
    pick = torch.full((tokens,), rows * width, dtype=torch.long)
    source = torch.arange(rows * width)[ran]
    pick.scatter_reduce_(0, at[ran], source, reduce="amin")
    return torch.cat([flat, flat.new_full((1, layers, k), -1)])[pick]


_REPLAYS: weakref.WeakKeyDictionary[nn.Module, RouterReplay] = weakref.WeakKeyDictionary()


@contextmanager
def routing(model: nn.Module, plan: RoutingPass | None) -> Iterator[RouterReplay | None]:
    """The forwards of ``model`` inside do what ``plan`` says with the routing (None, or
    a model with no mixture of experts: nothing). The hooks are put on the model's
    routers the first time (a rebuilt model gets its own)."""
    if plan is None or not (plan.replay or plan.record or plan.compare):
        yield None
        return
    replay = _REPLAYS.get(model)
    if replay is None:
        replay = _REPLAYS[model] = RouterReplay(model)
    if not replay.routers:
        yield None
        return
    replay.plan = plan
    try:
        yield replay
    finally:
        replay.plan, replay.given = None, None
        replay.own = [None] * len(replay.routers)
        replay.used = [None] * len(replay.routers)


def active_routing(model: nn.Module) -> RouterReplay | None:
    """The model's `RouterReplay` while a `routing` context is open on it, else None."""
    replay = _REPLAYS.get(model)
    return replay if replay is not None and replay.plan is not None else None

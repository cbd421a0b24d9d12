"""Which experts a mixture-of-experts model routed each token to, as a Batch column, and
how far the training forward's routing is from the rollout's.

A *routing record* (column ``routed_experts``, `ROUTES`) is ``[rows, P + R, layers,
top_k]``, aligned with ``input_ids``: at each position, the experts each mixture-of-
experts layer (in layer order, dense layers left out) chose for the token at that
position, i.e. the routing of the forward pass that took that token as input (a prompt
token is routed in the prefill, response token t in the decode step that feeds it in).
Integers: uint8 when the model has fewer than 255 experts, else int16, the dtype's
largest value (`unrouted`) wherever nothing was recorded (padding, and positions the
rollout did not run through its model).

The order of a token's k experts carries nothing (their outputs are summed), so two
routings *differ* when their sets of experts do (`routing_differs`).

The training side's comparison is made per row and summed on the controller, as
`rayrl.algos.probs_diff` is: `ROUTING_COLUMNS` counts, over a row's real tokens and
its mixture-of-experts layers, the decisions the record covers and those that differ;
`routing_metrics` turns the sums into fractions.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "ACTOR_ROUTES",
    "ROUTES",
    "ROUTING_COLUMNS",
    "as_index",
    "routes_dtype",
    "routing_differs",
    "routing_metrics",
    "unrouted",
]

ROUTES = "routed_experts"  # the rollout's record (router replay R3)
ACTOR_ROUTES = "actor_routed_experts"  # the actor's log-prob pass's record (R2)

# Per-row counts of a log-prob pass that had the rollout's record (float64), over the
# row's real positions but the last (its routing changes nothing trained):
ROUTING_COLUMNS = (
    "routing_positions",  # real token positions of the row
    "routing_recorded",  # of them, positions the record covers
    "routing_decisions",  # (position, layer) routing decisions the record covers
    "routing_mismatch",  # of them, where the experts the forward used differ from it
    "router_disagree",  # of them, where the router's own top-k differs from it
)


def routes_dtype(experts: int) -> torch.dtype:
    """The dtype of a routing record of a model with ``experts`` experts."""
    return torch.uint8 if experts < 255 else torch.int16


def unrouted(dtype: torch.dtype) -> int:
    """The value that marks a position with no recorded routing in a record of ``dtype``."""
    return int(torch.iinfo(dtype).max)


def as_index(routes: Tensor) -> Tensor:
    """A routing record as int64 expert indices, -1 where nothing was recorded."""
    index = routes.long()
    return index.masked_fill(routes == unrouted(routes.dtype), -1)


def routing_differs(a: Tensor, b: Tensor) -> Tensor:
    """``[..., layers]`` bool: the two routings' expert sets differ (``[..., layers, k]``
    each; the order of a token's k experts does not count)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def routing_metrics(rows: dict[str, Tensor]) -> dict[str, float]:
    """The log-prob pass's routing against the rollout's record, from `ROUTING_COLUMNS`
    of every row:

    - ``actor/routing_mismatch_frac``: of the (token, layer) decisions the rollout
      recorded, the fraction whose experts the actor's forward used differ (without
      replay: the router's own choice; with replay: 0);
    - ``actor/router_disagree_frac``: the same for the router's own top-k (with replay,
      the choices the replay overrode, given the replayed routing of earlier layers);
    - ``actor/routing_recorded_frac``: the fraction of the real token positions (each
      sequence's last one apart) the record covers.

    Nothing when the record covers no decision."""
    total = {key: float(rows[key].double().sum()) for key in ROUTING_COLUMNS}
    if total["routing_decisions"] == 0:
        return {}
    decisions = total["routing_decisions"]
    return {
        "actor/routing_mismatch_frac": total["routing_mismatch"] / decisions,
        "actor/router_disagree_frac": total["router_disagree"] / decisions,
        "actor/routing_recorded_frac": total["routing_recorded"]
        / max(total["routing_positions"], 1.0),
    }

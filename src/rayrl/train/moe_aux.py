"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model, added to
the training loss as the model's config says.

A transformers MoE causal LM whose config sets ``output_router_logits`` computes, in
every forward, ``aux_loss``: the Switch-Transformer load-balancing loss over the
forward's real tokens (``load_balancing_loss_func``); with labels it adds
``router_aux_loss_coef x aux_loss`` to its own loss. rayrl's engine never passes labels
(its losses are RL losses over response tokens), so it adds the same term itself:
`add_aux_loss` turns a micro-batch's ``aux_loss`` into its share of the mini-batch
(`rayrl.train.loss_contract`: weighted by the micro-batch's response tokens over the
mini-batch's), adds ``coef x share`` to the loss and reports the share as
``moe_aux_loss`` (the actor's ``actor/moe_aux_loss``). A model whose config does not
enable router logits, or a dense model, gets nothing added and no metric.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rayrl.batch import Batch

__all__ = ["AUX_KEY", "add_aux_loss", "aux_loss_coef"]

# The outputs key `rayrl.train.outputs.response_outputs` puts a forward's aux loss under.
AUX_KEY = "moe_aux_loss"


def aux_loss_coef(config: Any) -> float | None:
    """``router_aux_loss_coef`` when the config enables router logits, else None."""
    if not getattr(config, "output_router_logits", False):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def add_aux_loss(
    loss: Tensor, metrics: dict[str, Any], outputs: dict[str, Tensor], micro: Batch, config: Any
) -> Tensor:
    """``loss`` plus this micro-batch's share of ``coef x aux_loss`` when ``outputs``
    carry an aux loss and the config enables it; the share goes into ``metrics``."""
    coef = aux_loss_coef(config)
    aux = outputs.get(AUX_KEY)
    if coef is None or aux is None:
        return loss
    tokens = micro["response_mask"].sum().to(aux.dtype)
    share = aux * tokens / float(micro.meta["global_token_count"])
    metrics[AUX_KEY] = share.detach()
    return loss + coef * share

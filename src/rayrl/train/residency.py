"""Where a training engine's parameters and optimizer state live: device or host memory.

Two ways to move them:

* explicitly, `offload()` / `onload()` between phases (a caller that knows the
  schedule); while something is offloaded this way, calls that need it fail with a
  message saying to call `onload()`;
* by policy (verl's ``param_offload`` / ``optimizer_offload``): with
  ``param_offload`` the parameters live in host memory between engine calls and
  `resident()` brings them to the device for one call; with ``optimizer_offload`` the
  Adam moments live in host memory, and `step()` brings them to the device a slice of
  parameters at a time (``STEP_SLICE_BYTES`` of moments): the device never holds them
  whole (a 7B model's are 60 GB, which with its fp32 weights and gradients would not
  fit one 141 GB GPU). `stepping()` brings them all, for checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rayrl.train.fsdp import offload_model, offload_optimizer, onload_model, onload_optimizer

__all__ = ["STEP_SLICE_BYTES", "Residency"]

STEP_SLICE_BYTES = 4 << 30  # Adam moments on the device at once, with optimizer_offload


class Residency:
    """The placement of one engine's parameters and optimizer state."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        *,
        param_offload: bool = False,
        optimizer_offload: bool = False,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.param_offload = param_offload
        self.optimizer_offload = optimizer_offload and optimizer is not None
        self.explicit = {"params": False, "optimizer": False}
        self._params_home = False  # parameters in host memory by policy
        self.frozen = optimizer is None  # a reference policy: its weights never change
        if param_offload:
            offload_model(model, self.frozen)
            self._params_home = True

    # --------------------------------------------------------------- explicit
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters (and gradients) and/or optimizer state to host memory."""
        if params and not self.explicit["params"]:
            if not self._params_home:
                offload_model(self.model, self.frozen)
            self.explicit["params"] = True
        if optimizer and self.optimizer is not None and not self.explicit["optimizer"]:
            offload_optimizer(self.optimizer)
            self.explicit["optimizer"] = True

    def onload(self) -> None:
        """Bring back what `offload` moved (the policy's placement stays as it was)."""
        if self.explicit["params"]:
            self.explicit["params"] = False
            if not self.param_offload:
                onload_model(self.model, self.device)
        if self.explicit["optimizer"]:
            self.explicit["optimizer"] = False
            if not self.optimizer_offload:
                onload_optimizer(self.optimizer, self.device)

    def require(self, optimizer: bool) -> None:
        """Raise when something this call needs was offloaded explicitly."""
        off = [k for k, v in self.explicit.items() if v and (optimizer or k == "params")]
        if off:
            raise RuntimeError(
                f"the engine's {' and '.join(off)} are offloaded to CPU; call onload() first."
            )

    @property
    def on_device(self) -> bool:
        """Whether parameters and optimizer state all stay on the device between calls
        (no offload by policy, none explicit)."""
        return not (self._params_home or self.optimizer_offload or any(self.explicit.values()))

    # ----------------------------------------------------------------- policy
    @contextmanager
    def resident(self) -> Iterator[None]:
        """Parameters on the device inside the block; back home after, by policy."""
        if not self._params_home:
            yield
            return
        onload_model(self.model, self.device)
        self._params_home = False
        try:
            yield
        finally:
            offload_model(self.model, self.frozen)
            self._params_home = True

    def step(self) -> None:
        """The optimizer step. With ``optimizer_offload``, slice by slice of the
        parameters that have gradients: a slice's moments come to the device, the
        optimizer steps that slice (the others' gradients are hidden from it, so it
        skips them; Adam is elementwise, so the result is one whole step's), and the
        moments go home before the next slice."""
        optimizer = self._optimizer()
        if not self.optimizer_offload:
            optimizer.step()
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = {p: p.grad for p in params}
        try:
            for part in _slices(params, STEP_SLICE_BYTES // 2):  # two moments per element
                for p in params:
                    p.grad = None
                for p in part:
                    p.grad = grads[p]
                onload_optimizer(optimizer, self.device, part)
                optimizer.step()
                offload_optimizer(optimizer, part)
        finally:
            for p, grad in grads.items():
                p.grad = grad

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("a frozen engine (trainable=False) has no optimizer to step")
        return self.optimizer

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Optimizer state on the device inside the block (a checkpoint); back home after."""
        if not self.optimizer_offload:
            yield
            return
        onload_optimizer(self.optimizer, self.device)
        try:
            yield
        finally:
            offload_optimizer(self.optimizer)


def _slices(params: list[nn.Parameter], nbytes: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of about ``nbytes`` each (one parameter at least)."""
    part, size = [], 0
    for p in params:
        part.append(p)
        size += p.numel() * p.element_size()
        if size >= nbytes:
            yield part
            part, size = [], 0
    if part:
        yield part

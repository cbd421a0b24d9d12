"""A decoder-only transformer's sizes and what they add up to, for ``rayrl plan``'s
memory budget (`rayrl.models.memory`): parameters in all, those a token meets, those in
experts, the largest layer FSDP gathers, and the bytes a token's layer keeps for its
backward.

A dense model's sizes come from its ``config.json`` (`ModelShape.from_config`). A
mixture of experts also has an `ExpertShape`: ``experts`` SwiGLU experts of width
``intermediate`` on the layers ``layers`` marks (the others keep a dense MLP), of which
a token meets ``top_k``, beside a router and any shared expert that every token meets.
Which config keys say so is each model family's business (Qwen-MoE's
``decoder_sparse_step`` / ``mlp_only_layers``, Mixtral's ``num_local_experts``): the
families of `rayrl.rollout.native.families` read them, and ``rayrl plan`` builds the
shape from their spec (`rayrl.cli.plan_model`).

Expert parallelism (``ep`` ranks splitting the experts, `rayrl.train.expert_parallel`)
changes what one rank gathers: a layer's dense weights whole, and ``1/ep`` of its
experts (`ModelShape.gathered_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertShape", "ModelShape"]


@dataclass(frozen=True)
class ExpertShape:
    """A mixture of experts' sizes (`rayrl.rollout.native.spec.MoESpec`'s)."""

    experts: int
    top_k: int
    intermediate: int  # each expert's width
    layers: tuple[bool, ...]  # per layer: its MLP is this mixture (False: a dense MLP)
    shared: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False  # a sigmoid gate scales the shared expert (Qwen2-MoE)

    @property
    def sparse_layers(self) -> int:
        return sum(self.layers)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (a Hugging Face ``config.json``'s fields).

    ``head_dim`` 0 means ``hidden // heads``; ``qkv_bias``: q, k and v have biases
    (Qwen2's); ``qk_norm``: an RMSNorm on each head's q and k (Qwen3's).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    name: str = ""
    head_dim: int = 0
    qkv_bias: bool = True
    qk_norm: bool = False
    experts: ExpertShape | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "") -> ModelShape:
        """A dense model's shape from its config.json (a mixture of experts' is read by
        its family: `rayrl.cli.plan_model`)."""
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            name=name or (config.get("architectures") or [""])[0],
            head_dim=int(config.get("head_dim") or 0),
            qkv_bias=bool(config.get("attention_bias", True)),
        )

    # ------------------------------------------------------------------ widths
    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_size

    def is_sparse(self, layer: int) -> bool:
        return self.experts is not None and self.experts.layers[layer]

    # ------------------------------------------------------------------ parameters
    @property
    def attention_params(self) -> int:
        """q, k, v, o (with q, k, v biases and per-head q/k norms where the model has them)."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        biases = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_size if self.qk_norm else 0
        return h * (q + 2 * kv) + q * h + biases + norms

    def expert_params_of(self, layer: int) -> int:
        """Layer ``layer``'s routed experts' parameters (0: a dense layer)."""
        e = self.experts
        if e is None or not e.layers[layer]:
            return 0
        return e.experts * 3 * self.hidden * e.intermediate

    def layer_params(self, layer: int) -> int:
        """Layer ``layer``'s parameters: attention, two norms and its MLP (a dense one,
        or the router, the shared expert and every expert)."""
        h, e = self.hidden, self.experts
        base = self.attention_params + 2 * h
        if e is None or not e.layers[layer]:
            return base + 3 * h * self.intermediate
        shared = 3 * h * e.shared + (h if e.shared_gate else 0)
        return base + h * e.experts + shared + self.expert_params_of(layer)

    @property
    def dense_matrix_params(self) -> int:
        """The dense layers' q/k/v, o, gate/up and down matrices, all layers: what an FP8
        rollout holds in one byte each (`rayrl.rollout.native.fp8`)."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate
        return per_layer * sum(not self.is_sparse(i) for i in range(self.layers))

    @property
    def root_params(self) -> int:
        """Embedding, output head (unless tied) and final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return sum(self.layer_params(i) for i in range(self.layers)) + self.root_params

    @property
    def expert_params(self) -> int:
        """Parameters in routed experts, all layers (0 for a dense model)."""
        return sum(self.expert_params_of(i) for i in range(self.layers))

    @property
    def active_params(self) -> int:
        """Parameters one token meets: all but the experts its router does not pick."""
        e = self.experts
        if e is None:
            return self.params
        return self.params - self.expert_params * (e.experts - e.top_k) // e.experts

    def gathered_layer(self, ep: int = 1) -> int:
        """The largest layer one rank gathers whole in FSDP's forward: its dense weights,
        and ``1/ep`` of its experts with ``ep`` expert-parallel ranks."""
        return max(
            self.layer_params(i) - self.expert_params_of(i) * (ep - 1) // ep
            for i in range(self.layers)
        )

    # ------------------------------------------------------------------ activations
    def layer_activation_bytes(self, layer: int) -> int:
        """Bytes one token keeps in layer ``layer`` for its backward (bf16 compute, norms
        in float32): ``20 h + 4 q + 4 kv`` around attention, and the MLP's: ``8 i`` for
        a dense one; for a mixture, ``8 i`` for each of the ``top_k`` experts' copies and
        the shared expert, the copies' inputs and outputs (``4 top_k h``) and the
        router's float32 logits and probabilities (``8 experts``)."""
        h, e = self.hidden, self.experts
        attention = 20 * h + 4 * self.q_width + 4 * self.kv_width
        if e is None or not e.layers[layer]:
            return attention + 8 * self.intermediate
        mlp = 8 * (e.top_k * e.intermediate + e.shared) + 4 * e.top_k * h + 8 * e.experts
        return attention + mlp

    def activation_bytes(self) -> int:
        """The largest layer's `layer_activation_bytes` (the one recomputed at a time)."""
        return max(self.layer_activation_bytes(i) for i in range(self.layers))

    def all_activation_bytes(self) -> int:
        """One token's `layer_activation_bytes` over every layer (no checkpointing)."""
        return sum(self.layer_activation_bytes(i) for i in range(self.layers))

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV cache bytes of one token on one GPU of a ``tp``-way replica (bf16)."""
        heads = max(1, self.kv_heads // tp)
        return 2 * self.layers * heads * self.head_size * 2

    def describe(self) -> str:
        """One line: the parameters (total, active, in experts) and the shape."""
        shape = (
            f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads / "
            f"{self.kv_heads} KV of {self.head_size}, vocab {self.vocab}"
        )
        name = self.name or "model"
        e = self.experts
        if e is None:
            return f"{name} {self.params / 1e9:.2f} B parameters ({shape})"
        return (
            f"{name} {self.params / 1e9:.2f} B parameters, {self.active_params / 1e9:.2f} B "
            f"active per token ({shape}); experts: {self.expert_params / 1e9:.2f} B in "
            f"{e.experts} per layer on {e.sparse_layers} of {self.layers} layers, "
            f"{e.top_k} per token, width {e.intermediate}"
            + (f", a shared expert of width {e.shared}" if e.shared else "")
        )

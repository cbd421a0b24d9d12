"""Honest FLOP counts of a decoder-only transformer, and device peaks for MFU.

A token through the model costs ``2 x (matmul parameters it meets)`` FLOPs forward and
twice that backward, so training costs ``6 x params x tokens`` (Kaplan et al.), plus
attention, whose score and value products grow with the sequence length. Counted here:

* the body (every parameter except the input embedding, whose lookup does no matmul,
  and the output head) over every real token;
* the output head (``hidden x vocab``) over the tokens whose logits are used: in RL
  only the response tokens, since the engine never projects prompt positions;
* causal attention: ``2 x L^2 x (heads x head_dim)`` per layer forward for a sequence
  of ``L`` tokens (``QK^T`` and ``PV``, half of the square each).

A mixture-of-experts model counts its *active* parameters: each token meets only the
``top_k`` experts its router picks (``num_experts_per_tok``) of a block's ``E``, so
each 3-D expert weight (transformers 5's ``gate_up_proj`` / ``down_proj``, experts
on dim 0) counts ``top_k / E`` of its size; the router and any shared expert count
whole.

Padding, activation recomputation and the fused head's recomputed logits are not
counted: they are overhead, not useful work. `peak_flops` gives a device's dense
bf16 peak by name (None when unknown, e.g. a CPU); MFU is achieved over peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from rayrl.models.vision_language import vision_tower

__all__ = ["PEAK_BF16_FLOPS", "FlopModel", "peak_flops"]

# Dense bf16 tensor-core peak (no sparsity), FLOP/s, by a substring of the device name.
# The first match wins, so more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device (``torch.cuda.get_device_name()``), or None."""
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


@dataclass(frozen=True)
class FlopModel:
    """The FLOP-relevant sizes of one model.

    Attributes:
        body_params: parameters a token meets between the embedding and the head.
        head_params: the output head's ``hidden x vocab``.
        layers: decoder layers.
        attn_width: query heads times head size.
    """

    body_params: int
    head_params: int
    layers: int
    attn_width: int

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        """Sizes read from a Hugging Face causal LM (sharded parameters count whole). A
        vision-language model counts its language model only: its vision tower's FLOPs
        (per image, not per token) are not counted yet."""
        cfg = model.config.get_text_config(decoder=True)
        skip: set[int] = set()
        tower = vision_tower(model)
        for module in (model.get_input_embeddings(), model.get_output_embeddings(), tower):
            if module is not None:
                skip.update(id(p) for p in module.parameters())
        body = sum(p.numel() for p in model.parameters() if id(p) not in skip)
        body -= _inactive_expert_params(model, skip)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            body_params=body,
            head_params=cfg.hidden_size * cfg.vocab_size,
            layers=cfg.num_hidden_layers,
            attn_width=heads * head_dim,
        )

    def forward_flops(self, seq_lens: Sequence[int], head_tokens: int) -> float:
        """One forward pass over sequences of ``seq_lens`` real tokens, ``head_tokens``
        of which go through the output head."""
        tokens = float(sum(seq_lens))
        squares = float(sum(n * n for n in seq_lens))
        return (
            2.0 * self.body_params * tokens
            + 2.0 * self.head_params * head_tokens
            + 2.0 * self.layers * self.attn_width * squares
        )

    def train_flops(self, seq_lens: Sequence[int], head_tokens: int) -> float:
        """Forward plus backward (twice the forward): ``6 x params x tokens`` + attention."""
        return 3.0 * self.forward_flops(seq_lens, head_tokens)

    def batch_train_flops(
        self,
        attention_mask: Tensor,
        response_mask: Tensor | None,
        response_len: int,
        skipped_tokens: int = 0,
    ) -> float:
        """`train_flops` of a padded batch: real tokens from ``attention_mask``, the head
        over ``response_mask``'s tokens (default: the last ``response_len`` columns' real
        tokens); ``skipped_tokens`` of them not run through the body (prompts shared by
        several rows run once: `rayrl.train.shared_prompts`)."""
        lengths = attention_mask.sum(dim=-1).tolist()
        if response_mask is None:
            response_mask = attention_mask[:, -response_len:]
        skipped = 6.0 * self.body_params * skipped_tokens
        return self.train_flops(lengths, int(response_mask.sum())) - skipped


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _inactive_expert_params(model: nn.Module, skip: set[int]) -> int:
    """Expert weights a token does not meet: of each experts module's 3-D weights,
    ``1 - top_k / E`` (module docstring); 0 for a dense model."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    if not top_k:
        return 0
    inactive = 0
    for module in model.modules():
        weights: list[Tensor] = []
        for name in EXPERT_WEIGHTS:
            w = getattr(module, name, None)
            if isinstance(w, Tensor) and w.dim() == 3:
                weights.append(w)
        if len(weights) < len(EXPERT_WEIGHTS):
            continue  # not an experts module
        for w in weights:
            if id(w) not in skip:
                inactive += w.numel() - w.numel() * top_k // w.shape[0]
    return inactive

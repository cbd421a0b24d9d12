"""One forward step of the native engine: the tokens it runs and where their KV lives.

A step is either a *prefill* (chunks of one or more prompts, several tokens each) or a
*decode* (one token for each running sequence). Tokens of all sequences are packed
along one axis (no padding, except the rows a CUDA-graph bucket adds at the end). Each
sequence reads its KV cache blocks from one row of the engine's block table.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["PREFILL_TILE", "StepInput"]

PREFILL_TILE = 64  # query tokens per program of the Triton prefill kernel (`tiles`)


@dataclass
class StepInput:
    """Device tensors of one step (T tokens, S sequences).

    Attributes:
        input_ids: [T] token ids.
        positions: [T] position of each token in its sequence.
        slot_mapping: [T] cache slot each token's K/V is written to (-1: none).
        seq_rows: [S] block-table row of each sequence.
        seq_lens: [S] tokens in the cache of each sequence after this step.
        block_table: [rows, W] int32 cache block ids, row by row.
        logits_rows: [N] indices (into T) of the tokens whose next-token logits are needed.
        decode: True when every sequence has exactly one token (token i is sequence i).
        q_start: prefill only, [S + 1] offsets of each sequence's tokens in T.
        q_start_host, seq_lens_host, seq_rows_host: the same offsets, lengths and rows
            as Python lists (prefill).
        tiles: prefill on CUDA only, [n, 2] (sequence, first query index) of each
            PREFILL_TILE query tokens.
        mrope: a prefill with images (a vision-language model's), [3, T] each token's
            M-RoPE positions (time, height, width); ``positions`` then stay the tokens'
            indices (the cache's), and the rotation takes these.
        image_rows, image_features: a prefill with images, [K] the indices (into T) of
            its image placeholder tokens and [K, hidden] the features put there.
    """

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    seq_rows: Tensor
    seq_lens: Tensor
    block_table: Tensor
    logits_rows: Tensor
    decode: bool
    q_start: Tensor | None = None
    q_start_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    seq_rows_host: list[int] | None = None
    tiles: Tensor | None = None
    mrope: Tensor | None = None
    image_rows: Tensor | None = None
    image_features: Tensor | None = None

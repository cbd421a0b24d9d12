"""The native engine's prefix cache: full KV blocks found again by the tokens they hold.

A full block's keys and values depend only on the tokens before it and its own
(under one set of weights), so a block is known by a hash chained over them: block i
of a sequence is ``hash(hash of block i - 1, its block_size tokens)``. When a prefill's
blocks are filled, and when a decoding sample fills a block, the block is recorded
under its hash (with its tokens, checked on every hit: a hash collision can never hand
out a wrong block). A job admitted later (a prompt seen before: the rows of a GRPO group
sent again, a request re-queued; an episode recomputed after a preemption, whose earlier
turns are its own prefix) claims the blocks of its longest recorded prefix and prefills
only the rest. Blocks stay recorded while nobody owns them, in the allocator's free pool,
until it hands them out for something else (`BlockAllocator.on_evict`). At least the
last token of a prompt is always computed: its logits draw the first token.

A prompt with images (`rayrl.rollout.native.images`) chains its hashes from a *salt*,
a hash of its pixels, and a block's record holds that salt beside its tokens: the same
tokens with other images (a placeholder token stands for any image) never find its
blocks; a text prompt's salt is 0.

New weights or a freed cache make every record wrong: `clear` forgets them all.
"""

from __future__ import annotations

import numpy as np

from rayrl.rollout.native.kv_cache import BlockAllocator

__all__ = ["PrefixCache"]


class PrefixCache:
    """Blocks by content (module docstring); counts the prompt tokens it saved."""

    def __init__(self, alloc: BlockAllocator, block_size: int) -> None:
        self.alloc, self.block_size = alloc, block_size
        self._by_hash: dict[int, int] = {}  # chained hash -> block
        # block -> (hash, its tokens: the salt's bytes, then the tokens')
        self._of_block: dict[int, tuple[int, bytes]] = {}
        alloc.on_evict = self._evict
        self.hit_tokens = 0  # prompt tokens found cached
        self.looked_tokens = 0  # prompt tokens of the jobs looked up

    def chain(self, tokens: np.ndarray, blocks: int, salt: int = 0) -> list[int]:
        """The chained hashes of ``tokens``' first ``blocks`` full blocks (from ``salt``)."""
        bs, out, prev = self.block_size, [], salt
        for i in range(blocks):
            prev = hash((prev, _keyed(salt, tokens[i * bs : (i + 1) * bs])))
            out.append(prev)
        return out

    def match(self, tokens: np.ndarray, salt: int = 0) -> list[int]:
        """The recorded blocks of ``tokens``' longest cached prefix (not claimed), at
        most those before its last token; ``salt``: its images' (0: none)."""
        bs, found = self.block_size, []
        prev = salt
        for i in range((len(tokens) - 1) // bs):
            piece = _keyed(salt, tokens[i * bs : (i + 1) * bs])
            prev = hash((prev, piece))
            block = self._by_hash.get(prev)
            if block is None or self._of_block[block][1] != piece:
                break
            found.append(block)
        return found

    def claim(self, blocks: list[int], looked: int) -> None:
        """Take the matched blocks (each one more owner) for a job of ``looked`` tokens."""
        for b in blocks:
            self.alloc.claim(b)
        self.hit_tokens += len(blocks) * self.block_size
        self.looked_tokens += looked

    def record(self, blocks: list[int], tokens: np.ndarray, salt: int = 0) -> int:
        """Record ``blocks[i]`` as holding ``tokens``' full block i, for every full block
        (those recorded already stay as they are); the last full block's hash (``salt``:
        none), which `extend` chains on."""
        count = min(len(blocks), len(tokens) // self.block_size)
        hashes = self.chain(tokens, count, salt)
        bs = self.block_size
        for i, h in enumerate(hashes):
            self._put(blocks[i], h, _keyed(salt, tokens[i * bs : (i + 1) * bs]))
        return hashes[-1] if hashes else salt

    def extend(self, block: int, prev: int, tokens: np.ndarray, salt: int = 0) -> int:
        """Record ``block``, just filled with ``tokens`` after the block of hash ``prev``
        (of a prompt whose images' salt is ``salt``); its hash."""
        piece = _keyed(salt, tokens)
        h = hash((prev, piece))
        self._put(block, h, piece)
        return h

    def clear(self) -> None:
        """Forget every record (new weights, or the cache's memory freed)."""
        self._by_hash.clear()
        self._of_block.clear()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.looked_tokens if self.looked_tokens else 0.0

    def _put(self, block: int, h: int, piece: bytes) -> None:
        if h in self._by_hash:
            return  # another block holds these tokens already
        self._evict(block)
        self._by_hash[h] = block
        self._of_block[block] = (h, piece)

    def _evict(self, block: int) -> None:
        entry = self._of_block.pop(block, None)
        if entry is not None and self._by_hash.get(entry[0]) == block:
            del self._by_hash[entry[0]]


def _keyed(salt: int, tokens: np.ndarray) -> bytes:
    """A block's identity: its tokens' bytes, after its prompt's images' salt (if any)."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return data if not salt else np.int64(salt).tobytes() + data

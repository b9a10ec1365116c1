"""Paged KV block allocation with prefix caching by content hash.

A block holds `block_size` consecutive tokens' K/V for every layer of both causal LMs (the base and
residual LM caches are indexed by the same block ids). A full block's hash covers the token ids and
audio features of it and everything before it, so two requests that start with the same reference
voice share those blocks.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


def block_hashes(token_ids: list[int], feats: torch.Tensor, audio_mask: torch.Tensor, block_size: int,
                 salt: bytes = b"") -> list[bytes]:
    """Chained hashes of each full block of a prefill input (a block's token ids; with audio rows, also
    the mask and those rows' features), the chain started from `salt` (what else the KV depends on: an adapter)."""
    n = len(token_ids) // block_size * block_size
    ids = np.asarray(token_ids[:n], dtype=np.int64).tobytes()  # block i: bytes [i * stride, (i + 1) * stride)
    stride = 8 * block_size
    mask = audio_mask[:n].numpy().reshape(-1, block_size)
    hashes, prev = [], salt
    # Python bools and byte slices in the loop: a worker hashes a burst's prompts one after another in its first step.
    for i, has_audio in enumerate(mask.any(axis=1).tolist()):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[i * stride:(i + 1) * stride])
        if has_audio:
            rows = audio_mask[i * block_size:(i + 1) * block_size]
            h.update(mask[i].tobytes())
            h.update(feats[i * block_size:(i + 1) * block_size][rows].float().contiguous().numpy().tobytes())
        prev = h.digest()
        hashes.append(prev)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first (so cached blocks live longest), as (block id, how many times it
        # had been freed). A cache hit takes a block from the middle: it leaves the set at once and its queue entry
        # goes stale, skipped later (removing it from the deque would scan the whole free list: ~190k entries on a
        # large GPU); freed again, the block is queued at the back with its new count, and only that entry counts.
        self.frees = [0] * num_blocks
        self.free_queue: deque[tuple[int, int]] = deque((i, 0) for i in range(num_blocks))
        self.free_ids: set[int] = set(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id (block may be free but still holds the data)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, frees = self.free_queue.popleft()
            while not self._current(block_id, frees):  # stale: taken as a cache hit (and maybe freed) since
                block_id, frees = self.free_queue.popleft()
        self.free_ids.remove(block_id)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.ref_count = None, 1
        return block

    def allocate(self, seq: Sequence) -> None:
        """Blocks for the whole prefill input, reusing cached full blocks of an identical prefix."""
        assert not seq.block_table
        ids, feats, mask = seq.prefill_inputs()
        hashes = block_hashes(ids, feats, mask, self.block_size, seq.cache_salt)
        cached_tokens = 0
        for i in range(self.blocks_needed(len(ids))):
            h = hashes[i] if i < len(hashes) else None
            hit = self.cached.get(h) if h is not None else None
            # Never serve the last token from cache: its hidden state must be computed.
            if hit is not None and (i + 1) * self.block_size < len(ids) and cached_tokens == i * self.block_size:
                block = self.blocks[hit]
                if block.ref_count == 0:
                    self.free_ids.remove(hit)
                block.ref_count += 1
                cached_tokens += self.block_size
            else:
                block = self._take()
                if h is not None:
                    block.hash = h
                    self.cached[h] = block.block_id
            seq.block_table.append(block.block_id)
        seq.num_cached_tokens = cached_tokens

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.frees[block_id] += 1
                self.free_ids.add(block_id)
                self.free_queue.append((block_id, self.frees[block_id]))  # its hash stays valid until it is reused
        seq.block_table = []
        seq.num_cached_tokens = 0
        if len(self.free_queue) > 2 * len(self.blocks):  # drop stale entries left by cache hits
            free, frees = self.free_ids, self.frees  # ~2 x 190k entries on a large GPU: no call per entry
            self.free_queue = deque((i, n) for i, n in self.free_queue if i in free and n == frees[i])

    def _current(self, block_id: int, frees: int) -> bool:
        """Whether a free-queue entry stands for its block now: free, and queued by its latest free."""
        return block_id in self.free_ids and frees == self.frees[block_id]

    def forget_uncomputed(self, seq: Sequence) -> None:
        """A prefill that failed: its blocks past the cached prefix were entered in the cache when
        allocated but may never have been written; drop their hashes so no later request reuses them."""
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size:]:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash = None

    def needs_new_block(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether the next token (the patch fed back this step) starts a new block; `ahead`: steps
        launched for the sequence whose patches are not counted in it yet."""
        return (seq.num_tokens + ahead) // self.block_size >= len(seq.block_table)

    def append_slot(self, seq: Sequence, ahead: int = 0) -> int:
        """The cache slot of the next token, allocating a block when the last one is full."""
        pos = seq.num_tokens + ahead
        if pos // self.block_size >= len(seq.block_table):
            seq.block_table.append(self._take().block_id)
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

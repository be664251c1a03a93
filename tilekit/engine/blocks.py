"""The paged KV cache's block bookkeeping: one preallocated pool of blocks of BLOCK positions, handed to requests and
taken back in O(1), and prefix caching over it.

A block that holds a full block of a sequence's tokens is keyed by the hash of (its parent block's hash, its
tokens): two requests whose token sequences agree up to the end of a block share that block (its reference count
counts them), and a block whose last user has gone keeps its contents and its key, in the free queue, until it is
needed for something else: the least recently freed is reused first (LRU eviction), so a prefix that is asked for
again soon is found again. Block 0 is never handed out: padded rows of a step write into it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

NULL_BLOCK = 0


def block_hashes(tokens: Sequence[int], block: int, parent: bytes = b"") -> list[bytes]:
    """The keys of the full blocks of `tokens` (a sequence's tokens from its start): hash(parent key, block's tokens)
    chained from `parent` (the empty key for a sequence's first block)."""
    keys, ids = [], np.asarray(tokens, np.int64)
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.blake2b(parent + ids[start:start + block].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """`num_blocks` blocks (block 0 reserved), reference-counted, with a free queue in LRU order and the keys of the
    cached full blocks (prefix_caching). Not thread-safe: the engine's step loop owns it."""

    def __init__(self, num_blocks: int, block: int, prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.num_blocks, self.block, self.prefix_caching = num_blocks, block, prefix_caching
        self.refs = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.key_of: dict[int, bytes] = {}            # block -> its key, while it holds a cached full block
        self.block_of: dict[bytes, int] = {}          # key -> the block holding it
        self.queried_tokens = self.hit_tokens = 0

    @property
    def free(self) -> int:
        """Blocks that can be handed out now (cached ones no request holds count: they are evicted on demand)."""
        return len(self.free_queue)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached over prompt tokens looked up, since the start."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one request's new positions (reference count 1), the least recently freed first (a cached
        one loses its key); None, taking nothing, when fewer than n are free."""
        if n > len(self.free_queue):
            return None
        taken = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            key = self.key_of.pop(b, None)
            if key is not None:
                del self.block_of[key]
            self.refs[b] = 1
            taken.append(b)
        return taken

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (a prompt's full blocks), each taken (reference count
        + 1, out of the free queue)."""
        found = []
        if not self.prefix_caching:
            return found
        for key in keys:
            b = self.block_of.get(key)
            if b is None:
                break
            if self.refs[b] == 0:
                del self.free_queue[b]
            self.refs[b] += 1
            found.append(b)
        return found

    def record_start(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first start found cached_tokens of its prompt_tokens: the hit rate's counts (a request that
        could not start yet, or a preempted one resuming on its own blocks, is not counted)."""
        self.queried_tokens += prompt_tokens
        self.hit_tokens += cached_tokens

    def cache(self, b: int, key: bytes) -> None:
        """Block b now holds the full block `key`: later lookups find it (unless another block holds that key)."""
        if self.prefix_caching and b not in self.key_of and key not in self.block_of:
            self.key_of[b], self.block_of[key] = key, b

    def release(self, blocks: Sequence[int]) -> None:
        """A request is done with `blocks`: each one whose last user this was joins the free queue's end (a
        cached one keeping its key, to be found again until it is reused), in reverse order, so that a sequence's
        last blocks, the least likely to be shared, are evicted first."""
        for b in reversed(list(blocks)):
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_queue[b] = None

"""Paged KV blocks with a prefix cache, as the SIMULATOR models them (vLLM's ``BlockPool``).

A fixed set of blocks; the unreferenced ones (empty, or holding cached KV) wait in an LRU queue and
are evicted from its head when a new allocation needs them; a full block of computed KV is findable
by its prefix key until then.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    id: int
    ref_cnt: int = 0
    key: int | None = None  # prefix-cache key while the block holds a registered full block
    num_filled: int = 0  # tokens of KV written into it


class BlockPool:
    """A fixed set of KV blocks, an LRU queue of the unreferenced ones (cached or empty), and the
    prefix-cache map from block key to block (vLLM's ``BlockPool``)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self.num_filled_tokens = 0  # KV tokens in referenced blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def lookup(self, keys: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``keys``."""
        found: list[int] = []
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (touching them takes them out of it)."""
        return sum(1 for block_id in block_ids if self.blocks[block_id].ref_cnt == 0)

    def touch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                self.num_filled_tokens += block.num_filled
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached contents."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        allocated: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    del self._cached[block.key]
                block.key = None
            block.num_filled = 0
            block.ref_cnt = 1
            allocated.append(block_id)
        return allocated

    def free(self, block_ids: list[int]) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its prefix."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_filled_tokens -= block.num_filled
                self._free[block_id] = None

    def fill(self, block_id: int, num_filled: int) -> None:
        block = self.blocks[block_id]
        self.num_filled_tokens += num_filled - block.num_filled
        block.num_filled = num_filled

    def register(self, block_id: int, key: int) -> None:
        """Make a full block findable by its key; the first block registered under a key keeps it."""
        if key not in self._cached:
            self._cached[key] = block_id
            self.blocks[block_id].key = key

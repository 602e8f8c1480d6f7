"""The host tier (L2): snapshots evicted from the device kept in host memory, and found again by prefix.

Plain Python over host slot ids, like the device tier: a radix tree of its own (same class, the host
slot ids for slots) and an allocator of the host pool's slots. The engine's ``HostStatePool`` holds
the tensors; the moves between tiers are state ops the model runner executes in order with the
forward passes (``StateOps.offloads``, ``StateOps.loads``). A device snapshot evicted for space is
copied here (its key kept, least recently used host entries dropped to make room); a request whose
longest cached prefix lives only here gets a device slot filled from it, and the host entry stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mambaserve.server.cache.radix_tree import MambaRadixCache, TreeNode
from mambaserve.server.cache.slots import SlotAllocator


@dataclass(frozen=True)
class HostLock:
    """A matched host entry, locked until the load from it has run."""

    node: TreeNode

    @property
    def slot(self) -> int:
        return self.node.slot


class HostTier:
    def __init__(self, capacity: int, page_size: int = 1):
        self.allocator = SlotAllocator(capacity)
        self.tree = MambaRadixCache(page_size)
        self.evictions = 0

    def store(self, key: Sequence[int]) -> int | None:
        """A host slot to copy the state after ``key`` into, now owned by the tier; None when the key is
        here already or no entry can make room (all locked)."""
        if self.tree.match_prefix(key).length == len(key):
            return None  # (a refresh of the entry that holds it)
        slot = self.allocator.alloc()
        if slot is None:
            freed = self.tree.evict(1)
            self.evictions += len(freed)
            for s in freed:
                self.allocator.free(s)
            slot = self.allocator.alloc()
            if slot is None:
                return None
        if not self.tree.insert(key, slot).stored:
            self.allocator.free(slot)
            return None
        return slot

    def match(self, tokens: Sequence[int]) -> tuple[int, HostLock | None]:
        m = self.tree.match_prefix(tokens)
        if m.length == 0:
            return 0, None
        self.tree.lock(m.node)
        return m.length, HostLock(m.node)

    def unlock(self, lock: HostLock) -> None:
        self.tree.unlock(lock.node)

    def flush(self) -> int:
        slots = self.tree.flush()
        for s in slots:
            self.allocator.free(s)
        return len(slots)

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        assert set(self.tree.all_slots()) == self.allocator.used_slots(), "host slot leak"

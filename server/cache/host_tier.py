"""The host tier (L2): snapshots evicted from the device kept in host memory, and found again by prefix.

Plain Python over host slot ids, like the device tier: a radix tree of its own (same class, the host
slot ids for slots) and an allocator of the host pool's slots. The engine's ``HostStatePool`` holds
the tensors; the moves between tiers are state ops the model runner executes in order with the
forward passes (``StateOps.offloads``, ``StateOps.loads``). A device snapshot evicted for space is
copied here (its key kept, least recently used host entries dropped to make room, those with a copy
in the storage tier first); a request whose longest cached prefix lives only here gets a device slot
filled from it, and the host entry stays.

With a storage tier (``storage_tier``) the host pool is also its staging area: a write to storage reads
a *locked* host entry, a read from storage fills a *reserved* slot (allocated, in no tree) that joins
the tree when the read has landed (``commit``) or goes back (``release``).

The tier records the keys of the entries it drops to make room (``dropped``): a later prompt that misses
one of them is a capacity miss. For a hybrid model the entries are Mamba snapshots whose KV pages stay in
the device tree (``HybridRadixCache``, which marks the nodes they belong to): the device tree unmarks the
dropped ones, and the tier drops an entry whose KV the device tree evicted (``drop``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mambaserve.server.cache.radix_tree import MambaRadixCache, TreeNode
from mambaserve.server.cache.slots import SlotAllocator


@dataclass(frozen=True)
class HostLock:
    """A matched host entry, locked until the load from it (or the write to storage) has run. Hybrids:
    ``kv`` is the device tree's node at the entry's depth, locked with it (its pages are the prefix's KV)."""

    node: TreeNode
    kv: TreeNode | None = None

    @property
    def slot(self) -> int:
        return self.node.slot


class HostTier:
    def __init__(self, capacity: int, page_size: int = 1):
        self.allocator = SlotAllocator(capacity)
        self.tree = MambaRadixCache(page_size)
        self.reserved: set[int] = set()  # slots being filled from storage
        self.evictions = 0
        # the keys of entries dropped to make room: the owner remembers them as evicted (capacity misses) and
        # (hybrids) unmarks their nodes in the device tree
        self.dropped: list[tuple[int, ...]] = []

    def _alloc(self) -> int | None:
        slot = self.allocator.alloc()
        if slot is None:
            freed = self.tree.evict(1, keys=self.dropped, prefer=_stored)  # a copy in storage: nothing is lost
            self.evictions += len(freed)
            for s in freed:
                self.allocator.free(s)
            slot = self.allocator.alloc()
        return slot

    def store(self, key: Sequence[int]) -> int | None:
        """A host slot to copy the state after ``key`` into, now owned by the tier; None when the key is
        here already or no entry can make room (all locked)."""
        lock = self.store_locked(key)
        if lock is None:
            return None
        self.tree.unlock(lock.node)
        return lock.slot

    def store_locked(self, key: Sequence[int]) -> HostLock | None:
        """``store``, the new entry locked (the caller reads it once the copy into it has run)."""
        if self.tree.match_prefix(key).length == len(key):
            return None  # (a refresh of the entry that holds it)
        slot = self._alloc()
        if slot is None:
            return None
        r = self.tree.insert(key, slot)
        if not r.stored:
            self.allocator.free(slot)
            return None
        self.tree.lock(r.node)
        return HostLock(r.node)

    def lock_exact(self, key: Sequence[int]) -> HostLock | None:
        """The entry at exactly ``key``, locked; None if there is none."""
        m = self.tree.match_prefix(key)
        if m.length != len(key) or not key:
            return None
        self.tree.lock(m.node)
        return HostLock(m.node)

    def has(self, key: Sequence[int]) -> bool:
        """An entry at exactly ``key`` (its recency refreshed)."""
        return bool(key) and self.tree.match_prefix(key).length == len(key)

    def drop(self, key: Sequence[int]) -> None:
        """Drop the entry at exactly ``key`` (hybrids: the device tree evicted the KV it needs). Never a
        locked one: a load from it holds the KV's node locked too."""
        m = self.tree.match_prefix(key)
        slot = self.tree.take(m.node) if m.length == len(key) else None
        if slot is None:
            raise RuntimeError(f"no unlocked host entry at {len(key)} tokens to drop")
        self.allocator.free(slot)
        self.evictions += 1

    def keys(self) -> set[tuple[int, ...]]:
        """The keys of every entry (the invariant check)."""
        return {self.tree.key_of(node) for node in self.tree._owner.values()}

    def reserve(self) -> int | None:
        slot = self._alloc()
        if slot is not None:
            self.reserved.add(slot)
        return slot

    def commit(self, key: Sequence[int], slot: int) -> TreeNode | None:
        """A reserved slot now holding the state after ``key`` joins the tree (or is freed if the key is
        here already); returns the node holding ``key``."""
        self.reserved.discard(slot)
        r = self.tree.insert(key, slot)
        if not r.stored:
            self.allocator.free(slot)
        return r.node

    def release(self, slot: int) -> None:
        self.reserved.discard(slot)
        self.allocator.free(slot)

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
        tree = set(self.tree.all_slots())
        assert not tree & self.reserved, f"host slots both reserved and in the tree: {tree & self.reserved}"
        assert tree | self.reserved == self.allocator.used_slots(), "host slot leak"


def _stored(node: TreeNode) -> bool:
    return node.stored

"""Slot ownership between requests and the radix cache, and the deferred state operations it implies.

The scheduler asks this module for slots and tells it when states become worth keeping; the cache
records the state operations the next batch must run first (``copy_into``, ``clear``, ``restore``, and
the moves to and from the host tier it decides itself) and hands them over with ``take_pending``.
Plain Python over slot ids: the trees (``radix_tree``, ``host_tier``) and the allocators (``slots``)
are tensor-free; the model runner executes the operations on the device, in the order recorded,
before the batch's layers run (docs/design.md §3).

Where snapshots come from (docs/design.md §5):
  * admission: a request whose prompt prefix has a snapshot gets a slot filled by a deferred copy from
    it (copy-on-write; the tree's slot is never written by a request), or a load from the host tier,
    or takes the snapshot's slot over when no slot is free and nobody else reads it;
  * the prompt minus its last token: the prefill chunk that runs the last token (and samples the first
    output token) also writes the state before it into a fresh slot (``ForwardBatch.snap``);
  * the end of every prefill chunk that leaves the prompt unfinished: the request's slot is
    *donated* to the tree and the request continues in a fresh slot filled by a deferred copy;
  * tracked positions every ``track_interval`` tokens inside a prompt (``extra_buffer``): states
    emitted by the chunked scan are written into fresh slots during the forward;
  * the end of a finished request: its slot goes to the tree at what its state covers, prompt +
    output (or minus the last sampled token, whose state was never computed when no step ran it);
  * hybrids: where that is not on a page, the request's *rolling* snapshot instead: its state at the
    last page boundary it decoded past, copied into a spare slot during decode by a deferred ``copy``
    (``engine/rolling_snapshots.py``; allocated as a prompt's snapshot is, taken back by admission
    before it evicts).
Chunk ends, donations and tracked positions are *speculative*: they evict each other before a
conversation's state.
``DisabledCache`` keeps the same interface with no tree: the plain engine.

Hybrid models (``pages``: the KV page allocator) get a ``HybridRadixCache``: each request holds its
KV pages as a ``KVHold`` (``admit_kv``: the matched prefix's pages from the tree, kv-locked, and its own
from the page boundary after it); ``keep_kv`` gives the tree a page-aligned prefix of what a request
wrote (its pages, and a snapshot at its end) and points the request at the tree's pages from then on;
``release_kv`` frees the request's own pages and unlocks the tree's. Pages the tree releases (evicted
or pruned nodes) go back to the allocator at once. A Mamba-only cache (``pages is None``) does none of it.

A hybrid's host tier holds Mamba snapshots only: an evicted snapshot is offloaded as a Mamba-only one is,
and its node keeps its KV pages in the device tree (marked ``host``) as long as KV eviction spares them.
A host hit locks that node with the host entry and reads its pages; KV eviction of a marked node drops
the host entry, and the host tier making room unmarks one (``_sync_host``): a host snapshot is matched
only while the device tree holds the KV of every token before it (docs/design.md §7).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from mambaserve.server.cache.host_tier import HostLock, HostTier
from mambaserve.server.cache.hybrid_radix_tree import HybridRadixCache
from mambaserve.server.cache.pages import KVHold, PageAllocator, pages_for
from mambaserve.server.cache.radix_tree import MambaRadixCache, TreeNode
from mambaserve.server.cache.slots import SlotAllocator
from mambaserve.server.cache.storage_tier import MAX_INFLIGHT_WRITES, StorageTier


@dataclass(eq=False)
class KVCopy:
    """(hybrids) The K/V of tokens [a, b) of a sequence whose pages, in token order, are ``table``, between the
    KV pool and host tensors ``k``, ``v`` ``[b - a, La, Hkv, D]`` (the storage tier's entries): filled by the
    model runner when it runs a ``kv_out`` op, given to it for a ``kv_in`` op."""

    table: list[int]
    a: int
    b: int
    k: object | None = None
    v: object | None = None


@dataclass
class StateOps:
    """Deferred state mutations, run on the device before the next forward in the order recorded: a
    slot evicted and taken again within one step is read by an earlier op and written by a later one.
    Each op is (kind, a, b): ("copy", src slot, dst slot), ("clear", slot, slot), ("offload", slot,
    host slot), ("load", host slot, slot); hybrids' storage tier: ("kv_out", KVCopy, None) (pages to host
    tensors) and ("kv_in", KVCopy, None) (host tensors to pages)."""

    ops: list[tuple[str, int, int]] = field(default_factory=list)
    # called with a CUDA event (None on the CPU) once the ops are issued: storage writes that read a
    # host slot an offload above fills (storage_tier); empty without a storage tier
    on_done: list = field(default_factory=list)

    def copy(self, src: int, dst: int) -> None:
        self.ops.append(("copy", src, dst))

    def clear(self, slot: int) -> None:
        self.ops.append(("clear", slot, slot))

    def offload(self, slot: int, host_slot: int) -> None:
        self.ops.append(("offload", slot, host_slot))

    def load(self, host_slot: int, slot: int) -> None:
        self.ops.append(("load", host_slot, slot))

    def kv_out(self, copy: KVCopy) -> None:
        self.ops.append(("kv_out", copy, None))

    def kv_in(self, copy: KVCopy) -> None:
        self.ops.append(("kv_in", copy, None))

    def drop_writes_to(self, slot: int) -> None:
        self.ops = [op for op in self.ops if op[0] == "offload" or op[2] != slot]

    def runs(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Consecutive ops of one kind grouped, in order: (kind, [(a, b), ...]); a run is one launch. A copy
        that touches a slot another copy of the run writes, or writes one it reads, starts a new run: one
        launch copies in parallel (its destinations must be distinct from every source), and the order
        recorded decides (a snapshot evicted with a copy from it pending, its slot filled again at once)."""
        out: list[tuple[str, list[tuple[int, int]]]] = []
        reads: set[int] = set()
        writes: set[int] = set()
        for kind, a, b in self.ops:
            if not out or out[-1][0] != kind or (kind == "copy" and (a in writes or b in writes or b in reads)):
                out.append((kind, []))
                reads, writes = set(), set()
            out[-1][1].append((a, b))
            if kind == "copy":
                reads.add(a)
                writes.add(b)
        return out

    def __bool__(self) -> bool:
        return bool(self.ops or self.on_done)


class DisabledCache:
    enabled = False
    host: HostTier | None = None  # the host tier, where evicted snapshots go (PrefixCache with one)
    storage: StorageTier | None = None  # the storage tier below it (PrefixCache with a host tier)

    def __init__(self, allocator: SlotAllocator, pages: PageAllocator | None = None):
        self.allocator = allocator
        self.pages = pages  # hybrid models' KV pages (None: a Mamba-only model)
        self.pending = StateOps()
        self.evictions = 0

    def take_pending(self) -> StateOps:
        """The operations recorded since the last call: the caller runs them before anything reads a slot."""
        ops, self.pending = self.pending, StateOps()
        return ops

    def copy_into(self, src: int, dst: int) -> None:
        self.pending.copy(src, dst)

    def clear(self, slot: int) -> None:
        self.pending.clear(slot)

    def alloc(self, unused_since: int | None = None, speculative: bool = False) -> int | None:
        """A free slot, else (with a tree) the slot of the least recently used snapshot, one unused after the
        ``unused_since`` tick of ``clock`` (a snapshot kept in case it is needed must not displace one that
        requests used or queued for since its request arrived). For a speculative snapshot
        (``speculative``), another speculative one first: a conversation's state goes last."""
        return self.allocator.alloc()

    @property
    def clock(self) -> int:
        return 0

    def free(self, slot: int) -> None:
        # a deferred op into a slot that is given up must not land on its next owner
        self.pending.drop_writes_to(slot)
        self.allocator.free(slot)

    def match(self, tokens: Sequence[int]) -> tuple[int, object, str | None]:
        """Longest cached prefix of ``tokens``: (length, a lock on it, the tier it is in: "gpu" or "host").
        Fill a slot from it with ``restore``; unlock once that has *executed* (after the next forward)."""
        return 0, None, None

    def restore(self, lock, slot: int) -> None:
        """Record the fill of ``slot`` from the matched snapshot ``lock``: a copy, or a load from the host."""

    def keep(self, tokens: Sequence[int], slot: int, speculative: bool = False) -> bool:
        """Offer a state to the cache; True if it took the slot (else the caller still owns it).
        ``speculative``: kept in case it is needed (a chunk end, a tracked position), not a request's end."""
        return False

    def unlock(self, node: TreeNode | None) -> None:
        pass

    def take(self, node: TreeNode | None) -> int | None:
        """The slot of ``node``'s snapshot, moved out of the cache to the caller (None if it cannot be)."""
        return None

    def sole_reader_of_leaf(self, node: TreeNode | None) -> bool:
        return False

    def capacity_miss(self, tokens: Sequence[int], cached: int) -> int:
        return 0

    def touch(self, tokens: Sequence[int]) -> int:
        return 0

    def residency(self, tokens: Sequence[int]) -> dict[str, int]:
        """How much of ``tokens``' prefix each tier holds: {"gpu": n, "host": n, "storage": n} (longest
        snapshot in each), refreshing their recency like ``touch``."""
        return {"gpu": 0, "host": 0, "storage": 0}

    def write_to_storage(self, tokens: Sequence[int], slot: int) -> bool:
        """Copy the device state in ``slot`` (after ``tokens``) to the storage tier, through the host tier."""
        return False

    @property
    def tree_slots(self) -> int:
        return 0

    @property
    def evictable_slots(self) -> int:
        return 0

    # ---- KV pages (hybrid models) ----------------------------------------------------------------
    def admit_kv(self, node, cached: int, tokens: int) -> KVHold | None:
        """The KV pages of a request of ``tokens`` tokens whose first ``cached`` come from the matched
        ``node`` (locked by ``match``; None on a miss): the tree's pages for those, read-only and pinned
        until ``release_kv``, and its own for the rest. None (nothing held) when too few pages are free
        or evictable."""
        hold = KVHold()
        return hold if self.pages.ensure(hold, tokens) else None

    def extend_kv(self, hold: KVHold, tokens: int) -> bool:
        """Grow ``hold`` to ``tokens`` tokens (a session's next turn); False (nothing changed) if too few
        pages are free or evictable."""
        return self.pages.ensure(hold, tokens - len(hold.prefix) * self.pages.page_size)

    def trim_kv(self, hold: KVHold, tokens: int) -> None:
        """Free ``hold``'s own pages past its first ``tokens`` tokens (a session keeps what it wrote)."""
        self.pages.shrink(hold, tokens - len(hold.prefix) * self.pages.page_size)

    def keep_kv(self, hold: KVHold, tokens: Sequence[int], slot: int | None = None, speculative: bool = False) -> bool:
        """Give the cache the KV of ``tokens`` (a page-aligned prefix of what ``hold``'s request wrote) and,
        with ``slot``, the state after them; True if it took the slot. The request reads the cache's
        pages for that prefix from now on."""
        return False

    def release_kv(self, hold: KVHold | None) -> None:
        """A request's (or session's) pages given up: its own freed, the tree's unpinned."""
        if hold is not None:
            self.pages.release(hold)

    def block_table(self, hold: KVHold) -> list[int]:
        return hold.prefix + self.pages.pages(hold)

    def evictable_pages(self) -> int:
        """KV pages the cache could free now (metrics, admission)."""
        return 0

    def tree_pages(self) -> list[int]:
        """The KV pages the cache holds (the accounting check)."""
        return []

    def flush(self) -> int:
        return 0

    def check_invariants(self) -> None:
        pass


class PrefixCache(DisabledCache):
    enabled = True

    def __init__(self, allocator: SlotAllocator, page_size: int = 1, ghosts: int | None = None,
                 host: HostTier | None = None, pages: PageAllocator | None = None):
        super().__init__(allocator, pages)
        self.tree = (MambaRadixCache(page_size) if pages is None
                     else HybridRadixCache(page_size, host_below=host is not None))
        self.host = host  # evicted snapshots go there first (None: they are dropped)
        # Keys of snapshots evicted from any tier (device, host, storage), LRU-bounded (a tree with ids for
        # slots): a later prompt that would have matched one of them missed for lack of space, a miss more
        # cache would have turned into a hit (a *capacity* miss), unlike a prefix never seen (a compulsory
        # miss). Four times as many as the device and host tiers hold (up to an eighth more).
        self.ghosts = MambaRadixCache(page_size)  # (evicting as the tiers do: what a larger cache would keep)
        host_slots = host.allocator.capacity if host is not None else 0
        self.ghost_limit = ghosts if ghosts is not None else 4 * (allocator.capacity + host_slots)
        self._ghost_ids = itertools.count()
        self.page_evictions = 0  # leaves removed for their KV pages (hybrids; counted in `evictions` too)

    def alloc(self, unused_since: int | None = None, speculative: bool = False) -> int | None:
        slot = self.allocator.alloc()
        if slot is None and self.tree.evictable_slots:
            keys: list = []
            # a speculative snapshot displaces another one first; a conversation's state only when none is left
            freed = speculative and self.tree.evict(1, unused_since, keys, speculative_only=True)
            freed = freed or self.tree.evict(1, unused_since, keys)
            self.evictions += len(freed)
            for s, key in zip(freed, keys):
                if self.host is not None and (h := self.host.store(key)) is not None:
                    self.pending.offload(s, h)  # runs before anything recorded later writes to s
                    if self.storage is not None:
                        self._on_host(self.host.tree._owner[h], key)
                elif self.pages is not None and self.host is not None and not self.host.has(key):
                    self.tree.drop_host(key)  # no host entry took it (all locked): its KV need not stay
                self._sync_host()
                self.free(s)
                self._remember_evicted(key)
            if self.pages is not None:
                self._drain()
            slot = self.allocator.alloc()
        return slot

    def _sync_host(self) -> None:
        """After the tiers below made room: what the host tier (and the storage tier) dropped is remembered as
        evicted; hybrids: host entries whose node's KV was evicted dropped, nodes whose host entry was dropped
        for room unmarked: each tier holds what the other says."""
        if self.host is None:
            return
        if self.pages is not None:
            for key in self.tree.take_host_dropped():
                self.host.drop(key)
        while self.host.dropped:
            key = self.host.dropped.pop()
            if self.pages is not None:
                self.tree.drop_host(key)
            self._remember_evicted(key)
        while self.storage is not None and self.storage.deleted:
            self._remember_evicted(self.storage.deleted.pop())
        if self.pages is not None:
            self._drain()  # (the pages of nodes pruned when unmarked)

    def _drain(self) -> None:
        """Pages of nodes the tree removed, back to the allocator (hybrid models)."""
        if self.tree.released:
            self.pages.free(self.tree.take_released())

    def _remember_evicted(self, key: tuple[int, ...]) -> None:
        if self.ghost_limit <= 0:
            return
        held = self.ghosts.snapshot_slots
        if held >= self.ghost_limit + self.ghost_limit // 8:
            # an eighth over the limit, then back to it at once: evict scans the whole ghost tree (thousands of
            # keys with a host tier), once per eighth rather than once per eviction of every tier
            self.ghosts.evict(held - self.ghost_limit + 1)
        if not self.ghosts.insert(key, next(self._ghost_ids)).stored:
            self.ghosts.match_prefix(key)  # seen before: refresh it

    def capacity_miss(self, tokens: Sequence[int], cached: int) -> int:
        """Tokens of ``tokens`` beyond the ``cached`` hit that an evicted snapshot covered."""
        return max(0, self.ghosts.match_prefix(tokens).length - cached) if self.ghosts.snapshot_slots else 0

    @property
    def clock(self) -> int:
        return self.tree.clock

    def match(self, tokens: Sequence[int]) -> tuple[int, object, str | None]:
        m = self.tree.match_prefix(tokens)
        if self.host is not None and len(tokens) > m.length:
            length, lock = self.host.match(tokens)
            if length > m.length and self.pages is not None:  # (hybrids) with the KV of the prefix
                lock = self._with_kv(lock, tokens[:length])
            if length > m.length and lock is not None:  # the deeper snapshot wins, as on a Mamba model
                node = lock.node
                tier = "storage" if node.from_storage else "host"  # first use since it was read from disk
                node.from_storage = False
                if self._selective_write_due(node):
                    key = self.host.tree.key_of(node)
                    if self.storage.wants(key):
                        self._write_host(node, key)
                return length, lock, tier
            if lock is not None:
                self.host.unlock(lock)
        if m.length == 0:
            return 0, None, None
        self.tree.lock(m.node)
        if self._selective_write_due(m.node):
            self.write_to_storage(self.tree.key_of(m.node), m.node.slot)
        return m.length, m.node, "gpu"

    def _with_kv(self, lock: HostLock, key: Sequence[int]) -> HostLock | None:
        """A hybrid's host hit at ``key``, locked with the device tree's node there (its pages are the
        prefix's KV); None (the entry unlocked: a miss) if the tree lacks that KV, which the tiers'
        bookkeeping rules out and the invariant check reports."""
        kv = self.tree.host_node(key)
        if kv is None:
            self.host.unlock(lock)
            return None
        self.tree.lock(kv)
        return HostLock(lock.node, kv)

    def _selective_write_due(self, node: TreeNode) -> bool:
        """``write_through_selective``: a snapshot goes to storage at its N-th hit (once)."""
        node.hits += 1
        st = self.storage
        due = (st is not None and st.write_policy == "write_through_selective" and not node.stored
               and node.hits >= st.write_threshold)
        if due:
            node.stored = True  # written, or being written: not asked again
        return due

    def write_to_storage(self, tokens: Sequence[int], slot: int) -> bool:
        st = self.storage
        if st is None or not st.wants(tokens):
            return False
        lock = self.host.lock_exact(tokens)
        if lock is None:
            lock = self.host.store_locked(tokens)
            if lock is None:
                return False  # every host entry is in use: the write is skipped
            self.pending.offload(slot, lock.slot)
            if self.pages is not None:  # (hybrids) the host copy is usable with the tree's KV, like an evicted one
                self.tree.node_at(tokens).host = True
            self._sync_host()
        self._write(lock.node, tokens)
        return True

    def _write_host(self, node: TreeNode, key: Sequence[int]) -> None:
        """Host entry ``node`` (at ``key``) to storage: locked until written."""
        self.host.tree.lock(node)
        self._write(node, key)

    def _write(self, node: TreeNode, key: Sequence[int]) -> None:
        """Locked host entry ``node`` to storage; hybrids: with the KV of its tokens, whose pages stay pinned
        until it is written (KV eviction must not drop a locked host entry)."""
        kv_node = copy = None
        if self.pages is not None:
            kv_node = self.tree.node_at(key)
            self.tree.kv_lock(kv_node)
            copy = KVCopy(self.tree.pages_to(kv_node), 0, len(key))
            self.pending.kv_out(copy)
        self.storage.write_from_host(HostLock(node, kv_node), key, self.pending, copy)

    def _on_host(self, node: TreeNode, key: tuple[int, ...]) -> None:
        """An evicted device snapshot just got host entry ``node``: marked as having a storage copy (the
        host tier drops those first), or, under ``write_through``, written now if its write at insert
        was skipped (every staging slot was busy) or it was speculative."""
        if self.storage.has(key):
            node.stored = True
        elif self.storage.write_policy == "write_through" and self.storage.wants(key):
            self._write_host(node, key)
            node.stored = True

    def attach(self, storage: StorageTier) -> None:
        """The storage tier below the host tier; hybrids: an entry read from it lands its KV in the tree."""
        self.storage = storage
        storage.sync_host = self._sync_host
        if self.pages is not None:
            storage.land_kv, storage.unpin_kv = self._land_kv, self._unpin

    def _land_kv(self, key: Sequence[int], k, v) -> TreeNode | None:
        """(hybrids) An entry read from storage (its state in a host slot about to join the host tier at ``key``):
        its KV in the device tree, the pages the tree lacks filled from ``k``, ``v`` (a ``kv_in`` op), the node
        at ``key`` marked ``host``; returned locked (a request waits for it). None when too few pages can be had
        (the read is dropped: the request computes the prefix)."""
        node = self.tree.node_at(key)
        if node is None or not node.host:
            base, table, have = self.tree.kv_prefix(key)
            if base is not None:
                self.tree.kv_lock(base)  # (what making room evicts never takes the part it builds on)
            owner = KVHold()
            ok = self._ensure_pages(owner, len(key) - have)
            if base is not None:
                self.tree.kv_unlock(base)
            if not ok:
                self.pages.release(owner)
                self._drain()
                return None
            table = table + self.pages.detach(owner, len(self.pages.pages(owner)))
            node, dup = self.tree.insert_pages(key, table)
            assert not dup, "pages the tree lacked came back as duplicates"
            self.pending.kv_in(KVCopy(table, have, len(key), k[have:], v[have:]))
            node.host = True
        self.tree.kv_lock(node)
        return node

    def _unpin(self, node: TreeNode | None) -> None:
        if node is not None:
            self.tree.kv_unlock(node)
            self._drain()

    def write_back(self) -> None:
        """``write_back``: host entries about to be dropped are written to storage first."""
        st = self.storage
        for node in st.maintain() or ():
            if len(st.writing) >= MAX_INFLIGHT_WRITES:
                break
            key = self.host.tree.key_of(node)
            if st.has(key):
                node.stored = True
            elif st.wants(key):
                self._write_host(node, key)

    def residency(self, tokens: Sequence[int]) -> dict[str, int]:
        out = {"gpu": self.tree.match_prefix(tokens).length if tokens else 0, "host": 0, "storage": 0}
        if self.host is not None and tokens:
            out["host"] = self.host.tree.match_prefix(tokens).length
            if self.pages is not None and out["host"] > out["gpu"]:
                self.tree.host_node(tokens[:out["host"]])  # (hybrids) its KV is as recent as its snapshot
        if self.storage is not None and tokens:
            out["storage"] = self.storage.match_length(tokens)
        return out

    def restore(self, lock, slot: int) -> None:
        if isinstance(lock, HostLock):
            self.pending.load(lock.slot, slot)
        else:
            self.copy_into(lock.slot, slot)

    def unlock(self, lock) -> None:
        if isinstance(lock, HostLock):
            self.host.unlock(lock)
            if lock.kv is not None:
                self.tree.unlock(lock.kv)
                self._drain()
        elif lock is not None:
            self.tree.unlock(lock)
            if self.pages is not None:
                self._drain()

    def take(self, lock) -> int | None:
        if not isinstance(lock, TreeNode):
            return None
        slot = self.tree.take(lock)
        if self.pages is not None:
            self._drain()
        return slot

    def take_superseded(self, hold: KVHold | None, copying: TreeNode | None = None) -> int | None:
        """(hybrids) The slot of the deepest snapshot on the tree's part of a request's KV (``hold.node``: its
        match, or its last donation, and their ancestors), when nothing branches off below it (only the
        request's own path goes on) and no pending copy reads it: the request's deeper state, about to go to
        the tree on that path, supersedes it. For a pool full of the request's own conversation (each
        snapshot refreshed by its last match), where nothing older may be displaced. None otherwise.
        ``copying``: the node the request's own copy, recorded for the step being built, reads (its lock);
        when that copy is the only reader, the lock is released and the slot taken: the copy runs before
        anything the step writes (the caller forgets the lock)."""
        node = hold.node if hold is not None else None
        if not isinstance(node, TreeNode) or node.children:
            return None
        while node.slot is None:
            parent = node.parent
            if parent is None or parent is self.tree.root or len(parent.children) > 1:
                return None
            node = parent
        if node.lock_ref == 1 and node is copying:
            self.tree.unlock(node)
        return None if node.lock_ref else self.take(node)

    def sole_reader_of_leaf(self, lock) -> bool:
        """``lock`` (matched and locked by the caller) is a device leaf nobody else reads: taking its slot
        over costs no other request anything."""
        return isinstance(lock, TreeNode) and lock.lock_ref == 1 and not lock.children

    def touch(self, tokens: Sequence[int]) -> int:
        """Mark the snapshot ``tokens`` would match as just used (a queued request will read it: eviction
        spares it over older ones) and return its length, without locking it."""
        r = self.residency(tokens)
        return max(r["gpu"], r["host"])

    def keep(self, tokens: Sequence[int], slot: int, speculative: bool = False) -> bool:
        if not tokens:
            return False
        r = self.tree.insert(tokens, slot, speculative)  # (hybrid: only where the tree has the KV)
        if r.stored and not speculative and self.storage is not None:
            self.write_through(tokens, slot)
        return r.stored

    # ---- KV pages (hybrid models) ----------------------------------------------------------------
    def admit_kv(self, node, cached: int, tokens: int) -> KVHold | None:
        hold = KVHold()
        if isinstance(node, HostLock):
            node = node.kv  # a host snapshot: the device tree's pages up to it
        if isinstance(node, TreeNode) and cached:
            self.tree.kv_lock(node)
            hold.node, hold.prefix = node, self.tree.pages_to(node)
        if not self.extend_kv(hold, tokens):
            self.release_kv(hold)
            return None
        return hold

    def extend_kv(self, hold: KVHold, tokens: int) -> bool:
        return self._ensure_pages(hold, tokens - len(hold.prefix) * self.pages.page_size)

    def _ensure_pages(self, owner, tokens: int) -> bool:
        """Pages for ``owner``'s first ``tokens`` tokens, evicting the cache's least recently used leaves
        when too few are free (only when that makes enough)."""
        if self.pages.ensure(owner, tokens):
            return True
        short = pages_for(tokens, self.pages.page_size) - len(self.pages.pages(owner)) - self.pages.num_free
        if short > self.tree.evictable_pages():
            return False
        keys: list = []
        for s in self.tree.evict_pages(short, keys):
            self.free(s)
        self.evictions += len(keys)
        self.page_evictions += len(keys)
        for key in keys:
            self._remember_evicted(key)
        self._sync_host()
        self._drain()
        return self.pages.ensure(owner, tokens)

    def keep_kv(self, hold: KVHold, tokens: Sequence[int], slot: int | None = None, speculative: bool = False) -> bool:
        ps = self.pages.page_size
        n = len(tokens)
        if n % ps:
            raise ValueError(f"KV of {n} tokens is not a whole number of pages of {ps}")
        k, have = n // ps, len(hold.prefix)
        if k > have:
            mine = self.pages.pages(hold)[:k - have]
            node, dup = self.tree.insert_pages(tokens, hold.prefix + mine)
            self.pages.detach(hold, k - have)  # now the tree's, or duplicates of the tree's
            self.pages.free(dup)
            self.tree.kv_lock(node)
            if hold.node is not None:
                self.tree.kv_unlock(hold.node)  # an ancestor of `node`: nothing is pruned
            hold.node, hold.prefix = node, self.tree.pages_to(node)
        stored = slot is not None and self.keep(tokens, slot, speculative)
        self._drain()
        return stored

    def release_kv(self, hold: KVHold | None) -> None:
        if hold is None:
            return
        self.pages.release(hold)
        if hold.node is not None:
            self.tree.kv_unlock(hold.node)  # its path's leaf goes if no snapshot ended up there
            hold.node, hold.prefix = None, []
        self._drain()

    def evictable_pages(self) -> int:
        return self.tree.evictable_pages() if self.pages is not None else 0

    def tree_pages(self) -> list[int]:
        return self.tree.all_pages() if self.pages is not None else []

    def write_through(self, tokens: Sequence[int], slot: int) -> None:
        """``write_through``: the snapshot the tree just took at ``tokens`` (device ``slot``) goes to storage
        now; other policies write later (``_selective_write_due``, ``write_back``)."""
        if self.storage.write_policy == "write_through":
            node = self.tree.match_prefix(tokens).node
            node.stored = self.write_to_storage(tokens, slot) or node.stored

    @property
    def tree_slots(self) -> int:
        return self.tree.snapshot_slots

    @property
    def evictable_slots(self) -> int:
        return self.tree.evictable_slots

    def flush(self) -> int:
        """Empty the tree and the host tier (raises CacheBusyError while any snapshot is locked)."""
        slots = self.tree.flush()
        for s in slots:
            self.free(s)
        if self.pages is not None:
            self._drain()
        return len(slots) + (self.host.flush() if self.host is not None else 0)

    def check_invariants(self) -> None:
        """Every tier's tree and accounting: device slots, host slots (in a tree or reserved for a read),
        storage entries and bytes."""
        self.tree.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
            if self.pages is not None:  # (hybrids) every host entry has its KV in the tree, marked, and only those
                marks, entries = set(self.tree.host_marks()), self.host.keys()
                assert marks == entries, (f"host entries without their KV in the tree: {len(entries - marks)}, "
                                          f"marked nodes without a host entry: {len(marks - entries)}")
        if self.storage is not None:
            self.storage.check_invariants()

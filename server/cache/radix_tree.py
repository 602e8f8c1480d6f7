"""Mamba radix cache: a radix tree over token ids whose nodes may hold a state snapshot slot.

Pure Python over integers (docs/design.md §5): a *snapshot* is the id of a slot in the state pool holding
the Mamba state (conv + SSM) after the node's last token. No tensors live here; the engine copies
and frees the slots this tree names.

Rules the engine relies on:

* **Match.** ``match_prefix(key)`` walks the tree along ``key`` (splitting nothing) and returns the
  deepest path node that holds a snapshot; ``length`` is that node's depth in tokens (0 and the
  root on a miss). Path nodes below it without a snapshot, and a key ending inside an edge, do not
  count: a Mamba model can only resume from a stored state. The engine passes the prompt minus
  its last token (that token must run to produce logits), so ``cached_tokens == length``. A prompt
  sent twice hits only if a snapshot sits exactly at ``len(prompt) - 1`` (or shorter): inserting
  prompt+output at finish leaves that position mid-edge, so the engine must also insert the state
  it has at ``len(prompt) - 1`` (insert at any length works, splitting an edge if needed).
  With ``page_size > 1`` the key is first truncated down to a page multiple.
* **Insert and slot ownership.** ``insert(key, slot)`` stores ``slot`` as the snapshot after
  ``len(key)`` tokens. ``InsertResult.stored`` says who owns ``slot`` afterwards:
  ``stored=True`` -> the tree owns it (it comes back from ``evict``/``flush``);
  ``stored=False`` -> the caller still owns it and must free it. That happens when a snapshot
  already exists at that key (``existed=True``, ``node`` = that node; the tree keeps its own slot)
  or when the key is rejected (empty, or not a page multiple with ``page_size > 1``: the state is
  for ``len(key)`` tokens and cannot be moved to another depth; ``node=None``).
  Inserting a slot the tree already holds is a caller bug and raises ``ValueError``.
* **Locking.** ``lock(node)`` ref-counts the node and all its ancestors; snapshots on locked nodes
  are never evicted and locked nodes are never removed. Lock the node *before* using the slot it
  returned (before the copy-on-write is recorded) and unlock it once the copy has executed or the
  request ends; each ``lock`` needs exactly one ``unlock``. Locking the root (a miss) is allowed.
* **Eviction.** ``evict(n)`` frees up to ``n`` unlocked snapshots, least recently used first, and
  returns their slot ids (the caller returns them to the pool); ``take(node)`` removes one unlocked
  snapshot and hands its slot to the caller instead (the caller continues from that state). An inner node losing its snapshot
  stays as a *tombstone* (its children still need the path); a leaf without a snapshot is removed,
  then its childless, unlocked, snapshot-less ancestors too.
* **Recency.** A logical clock ticks once per ``match_prefix`` hit and per ``insert``; the tick is
  stamped on the touched node and all its ancestors (``last_access``, so ``parent.last_access >=
  child.last_access`` always) and on the touched node alone as its own last use (``used``). Eviction
  takes *superseded* snapshots first: those below which the tree is one path holding two snapshots or
  more (``_superseded``), a conversation's earlier turns, which only a prompt diverging right
  there would match (a regenerated answer, an edited message) while the conversation goes on from its
  deeper state; least recently used first by their own last use. (A prompt's snapshot with only its own
  answer's below is not superseded: the same prompt sent again, as a benchmark, a retry or a cycled document
  does, matches it.) Then the others by ``(last_access,
  depth)``: a leaf, or a prefix that branches below (a system prompt many conversations share, as recent as
  its most recent branch); among nodes touched by the same operation the shallower goes first. With path
  stamps alone (before, issue 31) a conversation's earlier turns were as recent as its latest state, so
  twelve chats sent round robin over room for all their latest states evicted the chats about to be sent,
  every round, instead of those earlier turns. A *global* "child more recent than parent" cannot hold under
  any path-touch LRU: touching S via branch X makes S newer than its idle branch Y (which is the right
  thing to evict first).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence


class CacheBusyError(RuntimeError):
    """The operation needs an idle tree, but some node is locked by a running request."""


class TreeNode:
    """One edge of the tree plus the node at its end.

    ``key`` holds the edge tokens from the parent; ``depth`` is the token count from the root to the
    end of this edge. Identity matters: requests hold ``TreeNode`` objects, so a split keeps the
    existing object as the lower half (where its snapshot and holders' expectations live).
    """

    __slots__ = ("key", "parent", "children", "depth", "slot", "lock_ref", "last_access", "used", "leaves",
                 "speculative", "hits", "stored", "from_storage", "pages", "kv_ref", "host")

    def __init__(self, key: tuple[int, ...], parent: TreeNode | None, depth: int, last_access: int = 0):
        self.key = key
        self.parent = parent
        self.children: dict[object, TreeNode] = {}  # first token (page_size 1) or first page -> child
        self.depth = depth
        self.slot: int | None = None  # snapshot slot id, None = no snapshot (tombstone or split point)
        self.lock_ref = 0  # locks on this node + locks on all its descendants
        self.last_access = last_access
        self.used = last_access  # the clock when a match or an insert last touched this node itself
        self.leaves = 1  # leaves at or below it (kept by _add_child / _remove_child): 1 below a conversation's turn
        self.speculative = False  # its snapshot was kept in case it is needed, and no request has used it yet
        # (tiers) matches of its snapshot, whether the storage tier has a copy, and (host tier) whether
        # the snapshot came from storage and has not been matched since
        self.hits = 0
        self.stored = False
        self.from_storage = False
        # (hybrid models, HybridRadixCache) the KV pages of the edge's tokens, and the requests / sessions
        # reading them (on this node and its descendants); empty and 0 in a Mamba-only tree
        self.pages: tuple[int, ...] = ()
        self.kv_ref = 0
        # (hybrid models with a host tier) the host tier holds a snapshot at this node's depth: the node
        # keeps its pages for it (a snapshot is usable only with the KV of every token before it)
        self.host = False

    def __repr__(self) -> str:
        return (f"TreeNode(depth={self.depth}, edge={len(self.key)}, slot={self.slot}, "
                f"lock_ref={self.lock_ref}, last_access={self.last_access}, children={len(self.children)})")


@dataclass(frozen=True)
class MatchResult:
    node: TreeNode  # deepest path node holding a snapshot, or the root on a miss
    length: int  # node.depth: the number of prompt tokens served from the cache

    @property
    def slot(self) -> int | None:
        return self.node.slot


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode | None  # node at exactly len(key) tokens; None when the key was rejected
    existed: bool  # a snapshot was already there; the tree kept it
    stored: bool  # the tree took ownership of the slot passed in (else the caller frees it)


def _require(cond: bool, msg: str) -> None:
    # Explicit raise rather than `assert`, so the checks also run under `python -O`.
    if not cond:
        raise AssertionError(msg)


def _rank(node: TreeNode) -> tuple[bool, int, int]:
    """Eviction order (module docstring, Recency): superseded snapshots first, by their own last use; then by path
    recency; shallower first."""
    if _superseded(node):
        return (False, node.used, node.depth)
    return (True, node.last_access, node.depth)


def _superseded(node: TreeNode) -> bool:
    """The tree below ``node`` is one path holding at least two snapshots: a later turn went on from it (a request
    leaves two, its prompt's and its answer's), not only ``node``'s own request's answer (a prompt sent again as it
    is matches the prompt's snapshot, never the answer's below it: that one does not supersede it)."""
    if not node.children or node.leaves != 1:
        return False
    below = 0
    while node.children:
        (node,) = node.children.values()
        below += node.slot is not None
        if below == 2:
            return True
    return False


class MambaRadixCache:
    """Radix tree of state snapshots with LRU eviction and lock ref-counts. See the module docstring."""

    def __init__(self, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._clock = 0
        self._reset()

    def _reset(self) -> None:
        self.root = TreeNode((), None, 0, self._clock)
        self._owner: dict[int, TreeNode] = {}  # slot -> node holding it
        self._evictable = 0
        self._protected = 0

    # ---------------------------------------------------------------- sizes

    @property
    def snapshot_slots(self) -> int:
        return len(self._owner)

    @property
    def evictable_slots(self) -> int:
        """Snapshots on unlocked nodes: what ``evict`` can free right now."""
        return self._evictable

    @property
    def protected_slots(self) -> int:
        """Snapshots on locked nodes (the matched node of a running request and its ancestors)."""
        return self._protected

    def all_slots(self) -> list[int]:
        return list(self._owner)

    # ---------------------------------------------------------------- match / insert

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Deepest snapshot on ``key``'s path; refreshes the recency of that node and its ancestors."""
        key = tuple(key)
        n = len(key) - len(key) % self.page_size
        node, pos, best = self.root, 0, self.root
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._common_len(child.key, key, pos, n)
            if m < len(child.key):
                break  # the key ends or diverges inside this edge: no state there
            node, pos = child, pos + m
            if node.slot is not None:
                best = node
        if best is not self.root:
            self._touch(best)
            best.speculative = False  # used: kept like any other from now on
        return MatchResult(best, best.depth)

    def _insert_key(self, key: Sequence[int], slot: int) -> tuple[int, ...]:
        """``key`` as a tuple, once ``slot`` is known to be a pool slot the tree does not hold yet."""
        if slot < 0:
            raise ValueError(f"slot {slot} is not a pool slot (negative slots mark padding rows)")
        if slot in self._owner:
            raise ValueError(f"slot {slot} is already held by the tree at depth {self._owner[slot].depth}")
        return tuple(key)

    def insert(self, key: Sequence[int], slot: int, speculative: bool = False) -> InsertResult:
        """Store ``slot`` as the snapshot after ``len(key)`` tokens; see the module docstring for ownership.
        ``speculative``: kept in case it is needed (``evict(..., speculative_only=True)`` may take it)."""
        key = self._insert_key(key, slot)
        n = len(key)
        if n == 0 or n % self.page_size:
            return InsertResult(None, existed=False, stored=False)
        node, pos = self.root, 0
        while pos < n:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                child = self._add_child(node, ck, TreeNode(key[pos:], node, n))
                node, pos = child, n
                break
            m = self._common_len(child.key, key, pos, n)  # >= 1 page: the first page matched
            if m < len(child.key):
                child = self._split(child, m)
            node, pos = child, pos + m
        return self._attach(node, slot, speculative)

    def _attach(self, node: TreeNode, slot: int, speculative: bool) -> InsertResult:
        self._touch(node)
        if node.slot is not None:
            return InsertResult(node, existed=True, stored=False)
        node.slot = slot
        node.speculative = speculative
        node.hits, node.stored, node.from_storage = 0, False, False  # a new snapshot
        self._owner[slot] = node
        if node.lock_ref:
            self._protected += 1
        else:
            self._evictable += 1
        return InsertResult(node, existed=False, stored=True)

    # ---------------------------------------------------------------- locking

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: their snapshots cannot be evicted until ``unlock``."""
        for n in self._path_to_root(node):
            if n.lock_ref == 0 and n.slot is not None:
                self._evictable -= 1
                self._protected += 1
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        path = self._path_to_root(node)
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock without a matching lock: {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.slot is not None:
                self._protected -= 1
                self._evictable += 1
        # A node locked while it had no snapshot may have become a tombstone leaf meanwhile.
        self._prune(node)

    # ---------------------------------------------------------------- eviction

    @property
    def clock(self) -> int:
        """The recency clock now: ``evict(..., unused_since=clock)`` later spares what is used from now on."""
        return self._clock

    def evict(self, num_slots: int, unused_since: int | None = None, keys: list | None = None,
              speculative_only: bool = False, prefer=None) -> list[int]:
        """Free up to ``num_slots`` unlocked snapshots, LRU first; returns their slot ids in order.
        ``unused_since``: only snapshots not used after that tick of ``clock``; ``speculative_only``: only
        speculative ones; ``keys``: the evicted snapshots' token keys are appended to it; ``prefer``: a
        predicate on nodes, those it holds for go first (a tier drops what a lower tier has a copy of).

        O(S log S) in the number of snapshots S per call, which is bounded by the state pool
        (hundreds to a few thousand slots), so a scan beats keeping an ordered index in sync.
        """
        if num_slots <= 0:
            return []
        candidates = [n for n in self._owner.values() if n.lock_ref == 0 and (n.speculative or not speculative_only)]
        if unused_since is not None:
            candidates = [n for n in candidates if _rank(n)[1] <= unused_since]
        order = _rank if prefer is None else (lambda n: (not prefer(n), _rank(n)))
        victims = heapq.nsmallest(num_slots, candidates, key=order)
        if keys is not None:
            keys.extend(self.key_of(node) for node in victims)
        return [self._evict_one(node) for node in victims]

    def _evict_one(self, node: TreeNode) -> int:
        return self._drop(node)

    def key_of(self, node: TreeNode) -> tuple[int, ...]:
        """The token ids from the root to the end of ``node``'s edge."""
        parts = []
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))  # (thousands of ids: at C speed)

    def take(self, node: TreeNode) -> int | None:
        """Remove ``node``'s snapshot and hand its slot to the caller, who owns it from now on (a move
        instead of a copy). None when the node holds no snapshot or is locked (someone copies from it)."""
        if node.slot is None or node.lock_ref:
            return None
        return self._drop(node)

    def _drop(self, node: TreeNode) -> int:
        slot = node.slot
        del self._owner[slot]
        node.slot = None
        self._evictable -= 1
        self._prune(node)  # leaf -> removed with its bare ancestors; inner node -> tombstone
        return slot

    def flush(self) -> list[int]:
        """Empty the tree and return every snapshot slot; refused while anything is locked."""
        if self.root.lock_ref:
            raise CacheBusyError(
                f"cannot flush the radix cache: {self.root.lock_ref} lock(s) held by running requests "
                f"({self._protected} protected snapshot(s))")
        slots = self.all_slots()
        self._reset()
        return slots

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Walk the whole tree; raise AssertionError naming the first broken invariant (debug mode)."""
        r = self.root
        _require(r.parent is None and r.key == () and r.depth == 0 and r.slot is None, f"bad root {r!r}")
        _require(r.last_access <= self._clock, "root stamped in the future")
        seen: dict[int, TreeNode] = {}
        evictable = protected = 0
        stack = [r]
        while stack:
            node = stack.pop()
            _require(node.lock_ref >= 0, f"negative lock count on {node!r}")
            child_locks = 0
            for ck, child in node.children.items():
                _require(child.parent is node, f"{child!r} has a wrong parent pointer")
                _require(len(child.key) > 0, f"empty edge at {child!r}")
                _require(ck == self._child_key(child.key, 0), f"{child!r} filed under a wrong child key")
                _require(len(child.key) % self.page_size == 0,
                         f"edge of {len(child.key)} tokens is not a multiple of page_size {self.page_size}")
                _require(child.depth == node.depth + len(child.key), f"wrong depth on {child!r}")
                _require(child.last_access <= node.last_access,
                         f"{child!r} is more recent than its parent {node!r}: a touch missed an ancestor")
                child_locks += child.lock_ref
                stack.append(child)
            _require(node.lock_ref >= child_locks,
                     f"{node!r} has fewer locks than its children together ({child_locks})")
            _require(node.leaves == (sum(c.leaves for c in node.children.values()) if node.children else 1),
                     f"{node!r} counts {node.leaves} leaves below it, its children say otherwise")
            if node is not r and node.slot is None and not node.children:
                _require(node.lock_ref > 0 or node.kv_ref > 0 or node.host,
                         f"tombstone leaf left in the tree: {node!r}")
            if node.slot is not None:
                _require(node.slot not in seen, f"slot {node.slot} held by two nodes")
                _require(self._owner.get(node.slot) is node, f"slot index out of date for {node!r}")
                seen[node.slot] = node
                if node.lock_ref:
                    protected += 1
                else:
                    evictable += 1
        _require(len(seen) == len(self._owner),
                 f"slot index holds {len(self._owner)} slots, tree holds {len(seen)}")
        _require((evictable, protected) == (self._evictable, self._protected),
                 f"evictable/protected counters {self._evictable}/{self._protected}, "
                 f"tree says {evictable}/{protected}")

    # ---------------------------------------------------------------- internals

    def _child_key(self, key: tuple[int, ...], pos: int) -> object:
        # Edges are page-aligned, so two children never share their first page.
        return key[pos] if self.page_size == 1 else key[pos:pos + self.page_size]

    def _common_len(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int, end: int) -> int:
        """Tokens of ``edge`` matching ``key[pos:end]``, rounded down to a page multiple."""
        limit = min(len(edge), end - pos)
        if key[pos:pos + limit] == edge[:limit]:  # common case: whole overlap matches (C-speed compare)
            m = limit
        else:  # a chat's next turn: the mismatch ~1,000 tokens in; slices of 64, then 8, then one by one
            m = 0  # (14 against 45 us a call for 1,100 tokens, token by token, on the CPU machine)
            for step in (64, 8):
                while key[pos + m:pos + m + step] == edge[m:m + step]:
                    m += step
            m = next(i for i in range(m, limit) if key[pos + i] != edge[i])
        return m - m % self.page_size

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child``'s edge after ``m`` tokens; the new upper node carries no snapshot."""
        parent = child.parent
        mid = TreeNode(child.key[:m], parent, child.depth - len(child.key) + m, child.last_access)
        mid.lock_ref = child.lock_ref  # every lock through `child` also passes through `mid`
        mid.leaves = child.leaves
        parent.children[self._child_key(child.key, 0)] = mid
        child.key = child.key[m:]
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        return mid

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        node.used = self._clock
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    def _add_child(self, parent: TreeNode, ck: object, child: TreeNode) -> TreeNode:
        """File a new leaf under ``parent``: a leaf more for ``parent`` and its ancestors unless ``parent`` was one."""
        if parent.children:
            self._count_leaves(parent, 1)
        parent.children[ck] = child
        return child

    def _remove_child(self, node: TreeNode) -> None:
        """Remove the leaf ``node`` from its parent (which becomes a leaf itself if it was its only child)."""
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None  # detach, so a stale reference fails loudly in lock/unlock
        if parent.children:
            self._count_leaves(parent, -1)

    @staticmethod
    def _count_leaves(node: TreeNode | None, change: int) -> None:
        while node is not None:
            node.leaves += change
            node = node.parent

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        path = []
        n = node
        while n is not None:
            path.append(n)
            n = n.parent
        if path[-1] is not self.root:
            raise ValueError(f"{node!r} is not in this tree (removed by eviction or flush?)")
        return path

    def _prune(self, node: TreeNode) -> None:
        """Remove ``node`` and then its ancestors while each is a bare, unlocked leaf."""
        while (node is not self.root and node.slot is None and not node.children
               and node.lock_ref == 0):
            parent = node.parent
            self._remove_child(node)
            node = parent

"""The radix tree of hybrid models: KV pages and Mamba state snapshots in one tree (docs/design.md §5, §11).

Pure Python over page and slot ids, like ``MambaRadixCache``, which it extends. What a hybrid adds:

* **Every node carries the KV pages of its edge's tokens** (``node.pages``, one page id per
  ``page_size`` tokens, in token order). Edges are page-aligned, so a split cuts the page list too. A
  node's *snapshot* (``node.slot``) is the Mamba state after its last token, as in the Mamba-only tree.
  So every path node has its KV, and a match (the deepest snapshot on the key's path) is usable whole:
  the request reads the path's pages (``pages_to``) and starts from a copy of the snapshot.
* **Two kinds of lock.** ``lock`` (inherited) pins a snapshot while its copy is pending; ``kv_lock``
  pins a node's pages and its ancestors' for as long as a request (or an idle session) reads them.
  A node under either is never removed; a snapshot on a node that is only kv-locked may still be
  evicted (the node becomes a tombstone: its KV stays for its reader).
* **Pages enter the tree by ``insert_pages``**, from a request that wrote them: the part of the key
  already in the tree keeps the tree's pages (the caller's copies there come back as duplicates, to
  be freed), a new suffix becomes a node owning the caller's pages. A snapshot (``insert``) attaches
  only where the KV is in the tree already.
* **A leaf without a snapshot is removed** with its pages unless kv-locked (KV past the deepest
  snapshot of a path serves no match). Pages of every removed node collect in ``released``; the
  owner of the page allocator takes them (``take_released``) and frees them.
* **Eviction, two LRUs.** ``evict`` (inherited) drops least recently used unlocked snapshots: an inner
  node becomes a tombstone and keeps its pages, a leaf goes with its pages. ``evict_pages`` removes
  least recently used unlocked leaves whole (pages and snapshot) until enough pages are released;
  their parents may become leaves and candidates in turn. ``evictable_pages`` counts the pages on
  nodes under no lock of either kind: removable by ``evict_pages`` one leaf after another.
* **A host tier below** (``host_below``): a snapshot ``evict`` drops goes to the host tier, so its node
  stays, with its pages, marked ``host`` (a leaf no longer goes with it): the host snapshot is usable
  only while the tree holds the KV of every token before it. The tree mirrors the host tier's keys
  that way; the owner (``PrefixCache``) keeps the two in step: ``drop_host`` unmarks a node whose
  host entry went (it is pruned if bare), and a marked node ``evict_pages`` removes leaves its key in
  ``host_dropped`` for the owner to drop the host entry. Marks never protect pages: KV eviction
  decides, and takes the host snapshots it makes useless with it.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from mambaserve.server.cache.radix_tree import InsertResult, MambaRadixCache, TreeNode, _require


class HybridRadixCache(MambaRadixCache):
    def __init__(self, page_size: int = 1, host_below: bool = False):
        self.host_below = host_below  # evicted snapshots go to a host tier: their nodes keep their pages
        super().__init__(page_size)

    def _reset(self) -> None:
        super()._reset()
        self.host_dropped: list[tuple[int, ...]] = []  # keys of marked nodes removed with their KV
        self.released: list[int] = []  # pages of removed nodes, not yet handed to the allocator's owner
        self._pages_held = 0
        self._evictable_pages = 0

    # ---------------------------------------------------------------- sizes

    @property
    def tree_pages(self) -> int:
        return self._pages_held

    def evictable_pages(self) -> int:
        """Pages on nodes no request or session reads and no pending copy pins: ``evict_pages`` can free them."""
        return self._evictable_pages

    def all_pages(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out += node.pages
            stack += node.children.values()
        return out

    def take_released(self) -> list[int]:
        """Pages of the nodes removed since the last call: the caller frees them."""
        out, self.released = self.released, []
        return out

    def pages_to(self, node: TreeNode) -> list[int]:
        """The KV pages of every token from the root to the end of ``node``'s edge, in token order."""
        parts = []
        while node is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # ---------------------------------------------------------------- insert

    def insert_pages(self, key: Sequence[int], pages: Sequence[int]) -> tuple[TreeNode, list[int]]:
        """Put the KV of ``key`` (``len(key)`` a page multiple; ``pages``: one per page, in token order) in
        the tree; returns the node ending at ``len(key)`` and the caller's pages the tree did not take
        (it had its own for those tokens: the caller frees them). A page equal to the tree's at its
        position is the tree's own (a matched prefix): neither taken nor returned."""
        key, ps = tuple(key), self.page_size
        n = len(key)
        if n % ps or len(pages) != n // ps:
            raise ValueError(f"{len(pages)} pages for a key of {n} tokens at page size {ps}")
        node, pos, dup = self.root, 0, []
        while pos < n:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                child = self._add_child(node, ck, TreeNode(key[pos:], node, n))
                child.pages = tuple(pages[pos // ps:])
                self._pages_held += len(child.pages)
                self._evictable_pages += len(child.pages)  # a new leaf: nothing locks it yet
                node, pos = child, n
                break
            m = self._common_len(child.key, key, pos, n)
            if m < len(child.key):
                child = self._split(child, m)
            first = pos // ps
            dup += [mine for mine, ours in zip(pages[first:first + m // ps], child.pages) if mine != ours]
            node, pos = child, pos + m
        if node is not self.root:
            self._touch(node)
        return node, dup

    def insert(self, key: Sequence[int], slot: int, speculative: bool = False) -> InsertResult:
        """Attach a snapshot where the tree holds the KV of ``key``'s tokens (splitting an edge if the key
        ends inside it); elsewhere it is refused (``stored=False``): a state without its KV serves no match."""
        key = self._insert_key(key, slot)
        n = len(key)
        if n == 0 or n % self.page_size:
            return InsertResult(None, existed=False, stored=False)
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return InsertResult(None, existed=False, stored=False)
            m = self._common_len(child.key, key, pos, n)
            if m < len(child.key):
                if pos + m < n:
                    return InsertResult(None, existed=False, stored=False)
                child = self._split(child, m)
            node, pos = child, pos + m
        return self._attach(node, slot, speculative)

    # ---------------------------------------------------------------- locks

    def lock(self, node: TreeNode) -> None:
        for n in self._path_to_root(node):
            if n.lock_ref == 0 and n.kv_ref == 0:
                self._evictable_pages -= len(n.pages)
        super().lock(node)

    def unlock(self, node: TreeNode) -> None:
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock without a matching lock: {node!r}")
        for n in self._path_to_root(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                if n.slot is not None:
                    self._protected -= 1
                    self._evictable += 1
                if n.kv_ref == 0:
                    self._evictable_pages += len(n.pages)
        self._prune(node)

    def kv_lock(self, node: TreeNode) -> None:
        """Pin the pages of ``node`` and its ancestors while a request or session reads them; one
        ``kv_unlock`` each."""
        for n in self._path_to_root(node):
            if n.kv_ref == 0 and n.lock_ref == 0:
                self._evictable_pages -= len(n.pages)
            n.kv_ref += 1

    def kv_unlock(self, node: TreeNode) -> None:
        if node.kv_ref <= 0:
            raise RuntimeError(f"kv_unlock without a matching kv_lock: {node!r}")
        for n in self._path_to_root(node):
            n.kv_ref -= 1
            if n.kv_ref == 0 and n.lock_ref == 0:
                self._evictable_pages += len(n.pages)
        self._prune(node)

    # ---------------------------------------------------------------- host tier marks

    def _evict_one(self, node: TreeNode) -> int:
        node.host = node.host or self.host_below  # the snapshot goes to the host: its KV stays for it
        return self._drop(node)

    def host_node(self, key: Sequence[int]) -> TreeNode | None:
        """The node ending exactly at ``key`` if it is marked (the host tier's snapshot there is usable),
        its recency refreshed (a hit from the host uses its KV)."""
        node = self.node_at(key)
        if node is None or not node.host:
            return None
        self._touch(node)
        return node

    def drop_host(self, key: Sequence[int]) -> None:
        """The host tier's entry at ``key`` went: unmark its node, pruned if nothing else keeps it."""
        node = self.node_at(key)
        if node is None or not node.host:
            raise RuntimeError(f"no host mark at {len(key)} tokens: the host tier and the tree disagree")
        node.host = False
        self._prune(node)

    def host_marks(self) -> list[tuple[int, ...]]:
        """The keys of every marked node (the invariant check compares them with the host tier's)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            if node.host:
                out.append(self.key_of(node))
        return out

    def take_host_dropped(self) -> list[tuple[int, ...]]:
        out, self.host_dropped = self.host_dropped, []
        return out

    def kv_prefix(self, key: Sequence[int]) -> tuple[TreeNode | None, list[int], int]:
        """The longest page-aligned prefix of ``key`` whose KV the tree holds: (the deepest node it reaches into,
        which pins it whole, or None; its pages, in token order; its length in tokens)."""
        key = tuple(key)
        node, pos, n, pages, deepest = self.root, 0, len(key), [], None
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._common_len(child.key, key, pos, n)
            pages += child.pages[:m // self.page_size]
            deepest, pos = child, pos + m
            if m < len(child.key):
                break
            node = child
        return deepest, pages, pos

    def node_at(self, key: Sequence[int]) -> TreeNode | None:
        key = tuple(key)
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None or self._common_len(child.key, key, pos, n) != len(child.key):
                return None
            node, pos = child, pos + len(child.key)
        return node if node is not self.root else None

    # ---------------------------------------------------------------- eviction

    def evict_pages(self, num_pages: int, keys: list | None = None) -> list[int]:
        """Remove least recently used unlocked leaves (their pages and snapshots) until ``num_pages``
        pages are released (into ``released``) or nothing more can go; returns the snapshot slots freed
        (the caller frees them). ``keys``: the removed leaves' token keys are appended to it."""
        if num_pages <= 0:
            return []
        heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            if self._removable_leaf(node):
                heap.append((node.last_access, node.depth, id(node), node))
        heapq.heapify(heap)
        released, slots = 0, []
        while heap and released < num_pages:
            *_, leaf = heapq.heappop(heap)
            if not self._removable_leaf(leaf):
                continue
            path = self._path_to_root(leaf)[1:]
            if keys is not None:
                keys.append(self.key_of(leaf))
            if leaf.host:  # its host snapshot is useless without this KV: the owner drops it
                leaf.host = False
                self.host_dropped.append(self.key_of(leaf))
            before = len(self.released)
            if leaf.slot is not None:
                slots.append(self._drop(leaf))  # removes the leaf with its pages, and its bare ancestors
            else:
                self._prune(leaf)
            released += len(self.released) - before
            above = next(n for n in path if n is self.root or n.parent is not None)
            if self._removable_leaf(above):
                heapq.heappush(heap, (above.last_access, above.depth, id(above), above))
        return slots

    def _removable_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and node.parent is not None and not node.children
                and node.lock_ref == 0 and node.kv_ref == 0)

    def flush(self) -> list[int]:
        """Empty the tree but the paths idle streaming sessions read (kv-locked, with no lock: nothing
        runs): those stay as tombstones holding their pages, as a session's live state stays outside a
        Mamba-only tree. Refused while a snapshot is locked."""
        if self.root.kv_ref and not self.root.lock_ref:
            slots = [self._drop(node) for node in list(self._owner.values())]  # nothing is locked
            for key in self.host_marks():  # the host tier is flushed with the tree
                self.drop_host(key)
            self.evict_pages(self._pages_held)
            self.host_dropped = []
            return slots
        pending = self.released + self.all_pages()
        slots = super().flush()
        self.released = pending
        return slots

    # ---------------------------------------------------------------- internals

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        mid = super()._split(child, m)
        k = m // self.page_size
        mid.pages, child.pages = child.pages[:k], child.pages[k:]
        mid.kv_ref = child.kv_ref  # every reader of `child` reads `mid` too
        return mid

    def _prune(self, node: TreeNode) -> None:
        while (node is not self.root and node.slot is None and not node.children
               and node.lock_ref == 0 and node.kv_ref == 0 and not node.host):
            parent = node.parent
            self._remove_child(node)
            self.released += node.pages
            self._pages_held -= len(node.pages)
            self._evictable_pages -= len(node.pages)
            node = parent

    def check_invariants(self) -> None:
        super().check_invariants()
        seen: set[int] = set()
        held = evictable = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = list(node.children.values())
            stack += kids
            _require(node.kv_ref >= sum(c.kv_ref for c in kids),
                     f"{node!r} has fewer KV readers than its children together")
            if node is self.root:
                _require(not node.pages, "the root holds pages")
                continue
            _require(len(node.pages) * self.page_size == len(node.key),
                     f"{node!r} holds {len(node.pages)} pages for an edge of {len(node.key)} tokens")
            _require(not seen & set(node.pages), f"a page of {node!r} is held by another node too")
            seen.update(node.pages)
            held += len(node.pages)
            if node.lock_ref == 0 and node.kv_ref == 0:
                evictable += len(node.pages)
        _require((held, evictable) == (self._pages_held, self._evictable_pages),
                 f"page counters {self._pages_held}/{self._evictable_pages}, tree says {held}/{evictable}")

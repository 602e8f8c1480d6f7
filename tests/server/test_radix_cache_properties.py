"""Property-based tests for the Mamba radix cache: random insert / match+lock / unlock / evict / flush.

The oracle is deliberately naive: a dict {key tuple: slot} of stored snapshots plus the list of
touch events (tick, key). It predicts match lengths and slots, which snapshots are pinned by locks,
the exact eviction order (superseded snapshots first — one path below them, holding two stored keys or
more — by their own last touch; then the rest by the least recent touch covering the key; shallower first
on ties) and the slot accounting (every stored slot is either in the tree or was returned exactly once).
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mambaserve.server.cache.hybrid_radix_tree import HybridRadixCache
from mambaserve.server.cache.radix_tree import CacheBusyError, MambaRadixCache

# Three token values and short keys give lots of shared prefixes, splits and tombstones.
KEYS = st.lists(st.integers(0, 2), max_size=8).map(tuple)


class RadixCacheMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize()
    def setup(self):
        self.cache = MambaRadixCache(page_size=self.page_size)
        self.model: dict[tuple, int] = {}  # stored snapshots: key -> slot
        self.events: list[tuple[int, tuple]] = []  # (tick, touched key), tick = operation order
        self.tick = 0
        self.locks: list[tuple] = []  # (node, key of the locked node, slot it held)
        self.next_slot = 1
        self.stored: set[int] = set()  # slots the tree took ownership of
        self.returned: list[int] = []  # slots given back by evict / flush

    # ------------------------------------------------------------ oracle

    def _touch(self, key):
        self.tick += 1
        self.events.append((self.tick, key))

    def _recency(self, key):
        return max(t for t, k in self.events if k[: len(key)] == key)

    def _eviction_order(self, key):
        """Superseded first (the tree below it is one path holding two snapshots or more), by its own last touch;
        then by path recency."""
        longer = [k for k in self._tree_keys() if len(k) > len(key) and k[:len(key)] == key]
        tips = {k for k in longer if not any(len(o) > len(k) and o[:len(k)] == k for o in longer)}
        if len(tips) == 1 and sum(k in self.model for k in longer) >= 2:
            return (False, max(t for t, k in self.events if k == key), len(key))
        return (True, self._recency(key), len(key))

    def _expected_match(self, query):
        n = len(query) - len(query) % self.page_size
        hits = [k for k in self.model if len(k) <= n and query[: len(k)] == k]
        return max(hits, key=len) if hits else ()

    def _tree_keys(self):
        """Every key the tree has a node ending at (what decides its shape)."""
        return set(self.model) | {k for _, k, _ in self.locks}

    def _pinned(self):
        return {k for k in self.model for _, lk, _ in self.locks if lk[: len(k)] == k}

    # ------------------------------------------------------------ rules

    @rule(key=KEYS)
    def insert_random(self, key):
        self._insert(key)

    def _insert(self, key):
        slot = self.next_slot
        self.next_slot += 1
        r = self.cache.insert(key, slot)
        if len(key) == 0 or len(key) % self.page_size:
            assert (r.node, r.existed, r.stored) == (None, False, False)
            return
        self._touch(key)
        assert r.node.depth == len(key)
        if key in self.model:
            assert r.existed and not r.stored and r.node.slot == self.model[key]
        else:
            assert r.stored and not r.existed and r.node.slot == slot
            self.model[key] = slot
            self.stored.add(slot)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def insert_near_existing(self, data):
        """Cut an existing key and maybe extend it: targets edge splits, also of locked edges."""
        locked = [k for _, k, _ in self.locks if k]
        if locked and data.draw(st.booleans(), label="under a lock"):
            base = data.draw(st.sampled_from(locked), label="locked base")
        else:
            base = data.draw(st.sampled_from(sorted(self.model)), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        suffix = data.draw(st.lists(st.integers(0, 2), max_size=3), label="suffix")
        self._insert(base[:cut] + tuple(suffix))

    @rule(key=KEYS, lock=st.booleans())
    def match_random(self, key, lock):
        self._match(key, lock)

    def _match(self, key, lock):
        m = self.cache.match_prefix(key)
        expected = self._expected_match(key)
        assert m.length == len(expected), (key, expected, m)
        assert m.node.slot == self.model.get(expected)
        if expected:
            self._touch(expected)
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m.node, expected, m.node.slot))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), lock=st.booleans())
    def match_near_existing(self, data, lock):
        """Query a stored key plus a random tail: a hit (often on an inner snapshot) to lock."""
        base = data.draw(st.sampled_from(sorted(self.model)), label="base")
        suffix = data.draw(st.lists(st.integers(0, 2), max_size=3), label="suffix")
        self._match(base + tuple(suffix), lock)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1), label="lock index")
        node, _, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        pinned = self._pinned()
        candidates = sorted((k for k in self.model if k not in pinned), key=self._eviction_order)
        expected = [self.model[k] for k in candidates[:n]]
        freed = self.cache.evict(n)
        assert freed == expected, (freed, expected)
        for k in candidates[:n]:
            del self.model[k]
        self.returned += freed

    @rule()
    def flush(self):
        if self.locks:
            try:
                self.cache.flush()
            except CacheBusyError:
                return
            raise AssertionError("flush succeeded while nodes were locked")
        freed = self.cache.flush()
        assert sorted(freed) == sorted(self.model.values())
        self.model.clear()
        self.returned += freed

    # ------------------------------------------------------------ invariants

    @invariant()
    def tree_invariants(self):
        self.cache.check_invariants()

    @invariant()
    def slot_accounting(self):
        in_tree = self.cache.all_slots()
        assert sorted(in_tree) == sorted(self.model.values())
        assert len(self.returned) == len(set(self.returned)), "a slot was returned twice"
        assert not set(self.returned) & set(in_tree), "a returned slot is still in the tree"
        assert set(self.returned) | set(in_tree) == self.stored, "a stored slot leaked"
        pinned = self._pinned()
        assert self.cache.protected_slots == len(pinned)
        assert self.cache.evictable_slots == len(self.model) - len(pinned)

    @invariant()
    def locked_snapshots_intact(self):
        for node, key, slot in self.locks:
            assert node.slot == slot and node.depth == len(key)
            top = node
            while top.parent is not None:
                top = top.parent
            assert top is self.cache.root, "a locked node was removed from the tree"


class PagedRadixCacheMachine(RadixCacheMachine):
    page_size = 2


SETTINGS = settings(max_examples=150, stateful_step_count=50, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestRadixCache = RadixCacheMachine.TestCase
TestRadixCache.settings = SETTINGS
TestPagedRadixCache = PagedRadixCacheMachine.TestCase
TestPagedRadixCache.settings = SETTINGS


class HybridRadixCacheMachine(RadixCacheMachine):
    """The same rules on the hybrids' tree, where every node carries the KV pages of its edge: a snapshot
    is inserted with the pages of its key (fresh ones; where the tree has the tokens already its pages
    stay and the fresh ones come back as duplicates), readers pin paths' pages (``kv_lock``), and KV
    eviction removes leaves whole. Oracle: the tree holds exactly one page per page-aligned prefix of
    every stored or pinned key, and every page handed out is in the tree, returned or released, once."""

    page_size = 2

    @initialize()
    def setup(self):
        super().setup()
        self.cache = HybridRadixCache(page_size=self.page_size)
        self.kv_locks: list[tuple] = []  # (node, key)
        self.next_page = 0
        self.handed: set[int] = set()  # pages given to insert_pages
        self.back: list[int] = []  # duplicates returned by insert_pages and pages released by the tree

    def _insert(self, key):
        if len(key) % self.page_size == 0:
            pages = list(range(self.next_page, self.next_page + len(key) // self.page_size))
            self.next_page += len(pages)
            self.handed.update(pages)
            node, dup = self.cache.insert_pages(key, pages)
            assert node.depth == len(key)
            self.back += dup
            # the tree kept its own pages for the tokens it had; the caller's came back for exactly those
            assert set(dup) | (set(self.cache.pages_to(node)) & set(pages)) == set(pages)
            if not key:
                return
            self.cache.kv_lock(node)  # (the request's hold while it inserts its snapshot)
            self.tick += 1  # insert_pages touched the node
            self.events.append((self.tick, key))
            super()._insert(key)
            self.cache.kv_unlock(node)
        else:
            super()._insert(key)
        self.back += self.cache.take_released()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def kv_lock(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)), label="key")
        node = self.cache.match_prefix(key).node
        self.tick += 1
        self.events.append((self.tick, key))
        self.cache.kv_lock(node)
        self.kv_locks.append((node, key))

    @precondition(lambda self: self.kv_locks)
    @rule(data=st.data())
    def kv_unlock(self, data):
        node, _ = self.kv_locks.pop(data.draw(st.integers(0, len(self.kv_locks) - 1), label="kv lock"))
        self.cache.kv_unlock(node)
        self.back += self.cache.take_released()

    @rule(n=st.integers(0, 6))
    def evict_pages(self, n):
        before = self.cache.tree_pages
        can = self.cache.evictable_pages()
        slots = self.cache.evict_pages(n)
        released = self.cache.take_released()
        self.back += released
        assert len(released) == before - self.cache.tree_pages
        assert len(released) >= min(n, can), (n, can, released)
        gone = [k for k, s in self.model.items() if s in slots]
        read = [k for _, k in self.kv_locks]
        assert not any(r[:len(k)] == k for k in gone for r in read), "evicted a leaf whose KV is being read"
        for k in gone:
            del self.model[k]
        self.returned += slots
        assert not any(n.slot in slots for n, _, _ in self.locks), "a locked snapshot was evicted"

    @rule()
    def evict(self, n=1):
        super().evict(n)
        self.back += self.cache.take_released()

    @rule()
    def flush(self):
        # every snapshot comes back (refused while one is locked); the pages of paths being read stay
        # (idle sessions' prefixes), everything else is released
        super().flush()
        self.back += self.cache.take_released()

    def _kept_for_host(self):
        return ()

    def _tree_keys(self):
        return super()._tree_keys() | {k for _, k in self.kv_locks} | set(self._kept_for_host())

    @invariant()
    def page_accounting(self):
        ps = self.page_size
        keys = [*self.model, *(k for _, k in self.kv_locks), *(k for _, k, _ in self.locks), *self._kept_for_host()]
        prefixes = {k[:j * ps] for k in keys for j in range(1, len(k) // ps + 1)}
        in_tree = self.cache.all_pages()
        assert len(in_tree) == self.cache.tree_pages == len(prefixes), (len(in_tree), sorted(prefixes))
        assert not self.cache.released, "released pages not taken"
        assert len(self.back) == len(set(self.back)), "a page came back twice"
        assert not set(self.back) & set(in_tree), "a page came back while the tree holds it"
        assert set(self.back) | set(in_tree) == self.handed, "a page leaked"
        for node, key in self.kv_locks:
            assert len(self.cache.pages_to(node)) == len(key) // ps and node.kv_ref > 0
        pinned = {k[:j * ps] for k in [*(k for _, k in self.kv_locks), *(k for _, k, _ in self.locks)]
                  for j in range(1, len(k) // ps + 1)}
        assert self.cache.evictable_pages() == len(prefixes - pinned)


TestHybridRadixCache = HybridRadixCacheMachine.TestCase
TestHybridRadixCache.settings = SETTINGS


class HybridHostMarksMachine(HybridRadixCacheMachine):
    """The hybrids' tree with a host tier below: an evicted snapshot's node stays, marked, with its pages
    (its host copy needs them); ``drop_host`` (the host tier dropped it) unmarks it and the bare ones go;
    KV eviction removes marked leaves like any other and reports their keys (the host copy goes too).
    Oracle: the marked keys, kept in the page accounting as pinned-by-nothing prefixes."""

    @initialize()
    def setup(self):
        super().setup()
        self.cache = HybridRadixCache(page_size=self.page_size, host_below=True)
        self.marks: set[tuple] = set()

    def _kept_for_host(self):
        return self.marks

    @rule()
    def evict(self, n=1):
        before = set(self.model)
        super().evict(n)
        self.marks |= before - set(self.model)  # to the host: marked

    @rule(n=st.integers(0, 6))
    def evict_pages(self, n):
        super().evict_pages(n)
        dropped = self.cache.take_host_dropped()
        assert set(dropped) <= self.marks and len(set(dropped)) == len(dropped), (dropped, self.marks)
        read = [k for _, k in self.kv_locks] + [k for _, k, _ in self.locks]
        assert not any(r[:len(k)] == k for k in dropped for r in read), "dropped a host copy whose KV is read"
        self.marks -= set(dropped)

    @precondition(lambda self: self.marks)
    @rule(data=st.data())
    def drop_host(self, data):
        key = data.draw(st.sampled_from(sorted(self.marks)), label="marked key")
        self.cache.drop_host(key)
        self.marks.discard(key)
        self.back += self.cache.take_released()

    @rule()
    def flush(self):
        super().flush()
        if not self.locks:  # the host tier is flushed with the tree
            self.marks.clear()

    @invariant()
    def marks_match(self):
        assert set(self.cache.host_marks()) == self.marks
        assert not self.cache.host_dropped, "host copies dropped and not reported"


TestHybridHostMarks = HybridHostMarksMachine.TestCase
TestHybridHostMarks.settings = SETTINGS

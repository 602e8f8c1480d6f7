"""Unit scenarios for the Mamba radix cache tree (issue 3): pure Python, no model, no tensors."""

import pytest

from mambaserve.server.cache.radix_tree import CacheBusyError, MambaRadixCache


def _edges(node):
    """The tree below ``node`` as nested {edge tuple: (slot, subtree)}, for structural asserts."""
    return {child.key: (child.slot, _edges(child)) for child in node.children.values()}


@pytest.fixture
def cache():
    c = MambaRadixCache()
    yield c
    c.check_invariants()


def test_empty_tree_operations(cache):
    for key in ([], [1], [1, 2, 3]):
        m = cache.match_prefix(key)
        assert m.node is cache.root and m.length == 0 and m.slot is None
    assert cache.evict(3) == []
    assert cache.evict(0) == []
    assert cache.flush() == []
    assert (cache.snapshot_slots, cache.evictable_slots, cache.protected_slots) == (0, 0, 0)
    assert cache.all_slots() == []
    cache.lock(cache.root)  # a miss may be locked uniformly with a hit
    cache.unlock(cache.root)
    r = cache.insert([], 5)  # the empty prefix has no snapshot to store
    assert (r.node, r.existed, r.stored) == (None, False, False)
    assert cache.snapshot_slots == 0


def test_insert_match_and_split(cache):
    r = cache.insert([1, 2, 3, 4], 10)
    assert r.stored and not r.existed and r.node.depth == 4
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).length == 4
    # Ending inside an edge or diverging from it is a miss, and match never splits.
    assert cache.match_prefix([1, 2]).length == 0
    assert cache.match_prefix([1, 2, 3, 9]).length == 0
    assert _edges(cache.root) == {(1, 2, 3, 4): (10, {})}

    leaf = r.node
    r2 = cache.insert([1, 2], 11)  # a prefix of an existing edge splits it
    assert r2.stored and r2.node.depth == 2
    assert _edges(cache.root) == {(1, 2): (11, {(3, 4): (10, {})})}
    assert leaf.parent is r2.node  # the snapshot node keeps its identity across the split
    m = cache.match_prefix([1, 2, 3, 9])
    assert (m.length, m.slot) == (2, 11)
    m = cache.match_prefix([1, 2, 3, 4, 7])
    assert (m.length, m.slot, m.node) == (4, 10, leaf)

    r3 = cache.insert([1, 2, 3, 5, 6], 12)  # diverging inside an edge: split point without snapshot
    assert r3.stored
    assert _edges(cache.root) == {(1, 2): (11, {(3,): (None, {(4,): (10, {}), (5, 6): (12, {})})})}
    assert cache.match_prefix([1, 2, 3]).length == 2  # the split point has no state: fall back
    assert cache.match_prefix([1, 2, 3, 5, 6, 0]).length == 5
    r4 = cache.insert([1, 2, 3, 5, 6, 7, 8], 13)  # a longer key extends below a leaf
    assert r4.node.parent is r3.node and r4.node.key == (7, 8)
    assert sorted(cache.all_slots()) == [10, 11, 12, 13]


def test_prompt_sent_twice_hits_when_engine_inserts_prompt_minus_last_token(cache):
    prompt, output = [5, 6, 7, 8], [9, 9]
    cache.insert(prompt + output, 1)  # finish of turn 1
    # Same prompt again: match key = prompt[:-1] ends mid-edge, so only prompt+output is no hit...
    assert cache.match_prefix(prompt[:-1]).length == 0
    # ...which is why the engine also stores the state it has at len(prompt) - 1.
    assert cache.insert(prompt[:-1], 2).stored
    m = cache.match_prefix(prompt[:-1])
    assert (m.length, m.slot) == (3, 2)
    # The next chat turn still resumes from the end of turn 1.
    assert cache.match_prefix(prompt + output + [4, 4]).length == 6


def test_duplicate_insert_reports_existing_and_keeps_the_tree_slot(cache):
    first = cache.insert([1, 2, 3], 7)
    dup = cache.insert([1, 2, 3], 8)
    assert dup.existed and not dup.stored and dup.node is first.node
    assert dup.node.slot == 7  # the caller must free slot 8 itself
    assert cache.all_slots() == [7] and cache.snapshot_slots == 1
    # A node that exists without a snapshot (split point) does take the slot.
    cache.insert([1, 2, 4], 9)
    mid = cache.insert([1, 2], 10)
    assert mid.stored and not mid.existed


def test_insert_rejects_bad_slots(cache):
    cache.insert([1], 3)
    with pytest.raises(ValueError, match="already held"):
        cache.insert([2], 3)
    with pytest.raises(ValueError, match="not a pool slot"):
        cache.insert([2], -1)


def test_tombstone_after_evicting_an_inner_snapshot(cache):
    cache.insert([1], 1)
    cache.insert([1, 2], 2)
    cache.insert([1, 2, 3, 4], 3)
    cache.match_prefix([1, 2, 3, 4])  # touches the path: [1] then [1,2] are the oldest on it
    assert cache.evict(1) == [1]  # shallowest of the path goes first
    assert cache.evict(1) == [2]
    # [1] and [1,2] are tombstones now: still there for the path, no state.
    assert _edges(cache.root) == {(1,): (None, {(2,): (None, {(3, 4): (3, {})})})}
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 4
    assert cache.match_prefix([1, 2, 9]).length == 0
    cache.check_invariants()
    # Evicting the leaf removes it and the bare tombstones above it.
    assert cache.evict(5) == [3]
    assert cache.root.children == {}


def test_match_through_tombstone_falls_back_to_nearest_snapshot_ancestor(cache):
    cache.insert([1, 1], 1)
    cache.insert([1, 1, 2, 2], 2)
    cache.insert([1, 1, 2, 2, 3, 3], 3)
    cache.match_prefix([1, 1, 2, 2, 3, 3])  # refresh the chain: order [1,1] < [1,1,2,2] < leaf
    cache.insert([1, 1, 2, 2, 3, 3], 9)  # duplicate: just refreshes again
    cache.insert([1, 1, 2, 2, 3, 3, 4, 4], 4)  # a later turn: [1,1] and [1,1,2,2] are superseded
    cache.match_prefix([1, 1])  # now [1,1] is newer than its descendants
    assert cache.evict(1) == [2]  # the inner [1,1,2,2] is the LRU superseded snapshot
    m = cache.match_prefix([1, 1, 2, 2, 7])
    assert (m.length, m.slot) == (2, 1)
    assert cache.match_prefix([1, 1, 2, 2, 3, 3]).length == 6


def test_eviction_order_is_lru_with_parents_before_children_on_a_touched_path(cache):
    cache.insert([1], 1)  # t1
    cache.insert([2], 2)  # t2
    cache.insert([3], 3)  # t3
    cache.match_prefix([1, 5])  # t4: [1] becomes most recent
    cache.insert([2, 2, 4], 4)  # t5: touches [2] and [2,2,4]
    cache.insert([2, 2, 5], 5)  # t6: [2] is a branch point now
    # Order: [3]@t3, [1]@t4, then [2]@t6 (shallower), [2,2,4]@t5 is older than it, [2,2,5]@t6.
    assert cache.evict(2) == [3, 1]
    assert cache.evict(10) == [4, 2, 5]
    assert cache.snapshot_slots == 0 and cache.root.children == {}


def test_a_conversations_earlier_turns_go_before_another_conversations_latest_state(cache):
    """Twelve chats sent round robin, two snapshots a turn (its prompt's, its answer's), room for all their latest
    states: a turn's earlier states are superseded (one path below them holding two snapshots or more), so eviction
    takes them, not the chat about to be sent."""
    chats = [[100 + k] for k in range(12)]
    slots = iter(range(10**6))
    for r in range(4):
        for k, chat in enumerate(chats):
            assert r == 0 or cache.match_prefix(chat).length == len(chat)  # its latest state is still there
            chat += [k, k]
            cache.insert(chat, next(slots))  # the prompt's
            chat += [7]
            cache.insert(chat, next(slots))  # the answer's
            cache.evict(max(0, cache.snapshot_slots - 26))  # room for 26 snapshots
    assert cache.snapshot_slots == 26


def test_a_prompt_with_only_its_own_answer_below_is_not_superseded(cache):
    """The same prompt sent again matches its prompt's snapshot, never its answer's: the answer alone does not
    push the prompt's out before older snapshots; a later turn below them does."""
    cache.insert([5], 1)  # an older, unrelated snapshot
    cache.insert([1, 2], 2)  # a prompt's
    cache.insert([1, 2, 3], 3)  # its answer's
    assert cache.evict(1) == [1]  # least recently used first: [1, 2] is not superseded by [1, 2, 3] alone
    cache.insert([1, 2, 3, 4], 4)  # the next turn's prompt...
    cache.insert([9], 5)
    cache.insert([1, 2, 3, 4, 5], 6)  # ...and answer: [1, 2] and [1, 2, 3] are earlier turns now
    assert cache.evict(2) == [2, 3]
    assert cache.evict(1) == [5]


def test_sibling_branch_not_refreshed_by_touching_parent(cache):
    cache.insert([0, 1], 1)  # system prompt
    cache.insert([0, 1, 7], 2)  # branch X
    cache.insert([0, 1, 8], 3)  # branch Y
    cache.match_prefix([0, 1, 7, 4])  # X hits: system prompt refreshed with it, Y is now the oldest
    assert cache.evict(1) == [3]
    assert cache.evict(1) == [1]  # then the system prompt, before the most recent branch
    assert cache.match_prefix([0, 1, 7]).length == 3


def test_locked_nodes_and_their_ancestors_survive_eviction(cache):
    cache.insert([1], 1)
    cache.insert([1, 2], 2)
    cache.insert([3], 3)
    m = cache.match_prefix([1, 2, 9])
    cache.lock(m.node)
    assert cache.evict(10) == [3]
    assert sorted(cache.all_slots()) == [1, 2]
    assert cache.match_prefix([1, 2]).node is m.node
    cache.check_invariants()
    cache.unlock(m.node)
    assert sorted(cache.evict(10)) == [1, 2]


def test_evictable_bookkeeping_across_lock_unlock(cache):
    cache.insert([1], 1)
    a = cache.insert([1, 2], 2).node
    b = cache.insert([1, 3], 3).node
    assert (cache.evictable_slots, cache.protected_slots, cache.snapshot_slots) == (3, 0, 3)
    cache.lock(a)
    assert (cache.evictable_slots, cache.protected_slots) == (1, 2)  # [1,2] and its ancestor [1]
    cache.lock(a)  # a second request on the same node
    cache.lock(b)
    assert (cache.evictable_slots, cache.protected_slots) == (0, 3)
    assert cache.evict(5) == []
    cache.check_invariants()
    cache.unlock(a)
    assert (cache.evictable_slots, cache.protected_slots) == (0, 3)
    cache.unlock(b)
    assert (cache.evictable_slots, cache.protected_slots) == (1, 2)
    cache.unlock(a)
    assert (cache.evictable_slots, cache.protected_slots) == (3, 0)
    with pytest.raises(RuntimeError, match="without a matching lock"):
        cache.unlock(a)


def test_insert_under_and_split_of_a_locked_path_keeps_counts(cache):
    leaf = cache.insert([1, 2, 3, 4], 1).node
    cache.lock(leaf)
    r = cache.insert([1, 2], 2)  # splits the locked edge: the new snapshot is protected at once
    assert r.node.lock_ref == 1
    assert (cache.evictable_slots, cache.protected_slots) == (0, 2)
    cache.insert([1, 2, 3, 4, 5], 3)  # below the locked node: not pinned
    assert (cache.evictable_slots, cache.protected_slots) == (1, 2)
    cache.check_invariants()
    cache.unlock(leaf)
    assert (cache.evictable_slots, cache.protected_slots) == (3, 0)


def test_flush_refused_while_locked_then_returns_everything(cache):
    cache.insert([1, 2], 1)
    cache.insert([1, 3], 2)
    miss = cache.match_prefix([9])
    cache.lock(miss.node)  # even a request that missed counts as running
    with pytest.raises(CacheBusyError, match="1 lock"):
        cache.flush()
    assert cache.snapshot_slots == 2  # nothing changed
    cache.unlock(miss.node)
    node = cache.match_prefix([1, 2]).node
    assert sorted(cache.flush()) == [1, 2]
    assert cache.root.children == {} and cache.snapshot_slots == 0
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(node)  # a stale node from before the flush


def test_lock_on_evicted_node_is_refused(cache):
    node = cache.insert([1, 2], 1).node
    cache.evict(1)
    with pytest.raises(ValueError, match="not in this tree"):
        cache.lock(node)


def test_unlock_prunes_a_tombstone_that_became_a_leaf_while_locked(cache):
    cache.insert([1, 2], 1)
    cache.insert([1, 3], 2)
    split_point = cache.root.children[1]
    assert split_point.slot is None
    cache.lock(split_point)  # unusual (hybrid models may pin KV-only nodes) but legal
    cache.evict(2)
    assert split_point.parent is cache.root  # kept while locked
    cache.check_invariants()
    cache.unlock(split_point)
    assert cache.root.children == {}


def test_page_size_alignment():
    cache = MambaRadixCache(page_size=2)
    r = cache.insert([1, 2, 3], 1)  # the state after 3 tokens cannot live at a page boundary
    assert (r.node, r.existed, r.stored) == (None, False, False)
    assert cache.insert([1, 2, 3, 4], 2).stored
    assert cache.insert([1, 2, 3, 5], 3).stored  # diverges inside page 2: split at token 2
    assert _edges(cache.root) == {(1, 2): (None, {(3, 4): (2, {}), (3, 5): (3, {})})}
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 4  # key truncated to 4 tokens
    assert cache.match_prefix([1, 2, 3]).length == 0  # truncated to [1, 2]: no state there
    assert cache.insert([1, 2], 4).stored
    assert cache.match_prefix([1, 2, 3]).length == 2
    assert cache.match_prefix([1, 2, 3, 6]).length == 2
    cache.check_invariants()
    with pytest.raises(ValueError):
        MambaRadixCache(page_size=0)


def test_check_invariants_catches_corruption(cache):
    a = cache.insert([1, 2], 1).node
    cache.insert([1, 3], 2)
    cache.check_invariants()
    a.lock_ref = 1  # a lock that skipped the ancestors
    with pytest.raises(AssertionError, match="fewer locks than its children"):
        cache.check_invariants()
    a.lock_ref = 0
    a.last_access = 10**6
    with pytest.raises(AssertionError, match="more recent than its parent"):
        cache.check_invariants()
    a.last_access = 0
    a.slot = None  # a snapshot dropped without bookkeeping -> tombstone leaf + stale slot index
    with pytest.raises(AssertionError, match="tombstone leaf"):
        cache.check_invariants()
    a.slot = 1


def test_speculative_eviction_spares_used_and_conversation_snapshots():
    """``speculative_only`` evicts only snapshots kept in case they are needed; a match promotes one."""
    t = MambaRadixCache()
    t.insert([1, 2, 3], 0)  # a request's end
    t.insert([1, 2, 3, 4, 5], 1, speculative=True)
    t.insert([7, 8], 2, speculative=True)
    t.match_prefix([7, 8, 9])  # used by a request: kept like any other from now on
    assert t.evict(3, speculative_only=True) == [1]
    keys: list = []
    assert sorted(t.evict(3, keys=keys)) == [0, 2] and sorted(keys) == [(1, 2, 3), (7, 8)]


def test_hybrid_tree_pages_split_pin_and_go_with_their_leaves():
    """Hybrids' tree (page size 2): a node's pages split with its edge; a reader's pin keeps a path whose
    snapshot is evicted (a tombstone leaf) until it lets go; KV eviction removes least recently used
    unpinned leaves whole, then a parent that became a leaf."""
    from mambaserve.server.cache.hybrid_radix_tree import HybridRadixCache

    t = HybridRadixCache(page_size=2)
    node, dup = t.insert_pages([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert dup == [] and t.insert([1, 2, 3, 4, 5, 6], 0).stored
    node2, dup = t.insert_pages([1, 2, 3, 4, 7, 8], [20, 21, 22])  # shares 2 pages: the tree keeps its own
    assert dup == [20, 21] and t.pages_to(node2) == [10, 11, 22]
    assert t.insert([1, 2, 3, 4, 7, 8], 1).stored and t.insert([1, 2, 3, 4], 2).stored  # the split point
    assert node.parent.key == (1, 2, 3, 4) and node.parent.pages == (10, 11) and node.pages == (12,)
    assert not t.insert([9, 9], 3).stored  # no KV for those tokens in the tree: refused
    t.kv_lock(node2)
    assert t.evictable_pages() == 1  # node's page; node2 and their parent are read
    assert t.evict(3) == [0, 1, 2]  # snapshots, LRU: node2 stays, pinned, as a tombstone leaf
    assert sorted(t.take_released()) == [12] and t.all_pages() == [10, 11, 22] and t.evictable_pages() == 0
    t.kv_unlock(node2)  # the reader is done: its snapshot-less leaf goes, then its bare parent
    assert sorted(t.take_released()) == [10, 11, 22] and t.root.children == {}
    for key, pages, slot in (([1, 2], [30], 4), ([1, 2, 3, 4], [30, 31], 5), ([5, 6], [32], 6)):
        n, _ = t.insert_pages(key, pages)
        t.insert(key, slot)
    assert t.evict_pages(2) == [5, 4]  # the oldest leaf, then its parent once a leaf; [5, 6] is newer
    assert sorted(t.take_released()) == [30, 31] and t.all_pages() == [32]
    t.check_invariants()

"""KV page accounting for hybrid models' attention layers: which pages are free, which belong to whom.

Plain Python over page ids; the tensors are the engine's ``KVPool``. A page holds ``page_size``
consecutive tokens of one sequence in every attention layer; a sequence's pages, in order, are its
block table row. Token ``p`` of a sequence lives at ``pages[p // page_size] * page_size + p % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PageAllocator:
    def __init__(self, capacity: int, page_size: int):
        if capacity < 1 or page_size < 1:
            raise ValueError(f"the KV pool needs at least one page of at least one token (got {capacity} pages "
                             f"of {page_size})")
        self.capacity, self.page_size = capacity, page_size
        self._free = list(range(capacity - 1, -1, -1))  # LIFO: a just-freed page is reused first
        self._owned: dict[object, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def pages(self, owner) -> list[int]:
        """``owner``'s pages in token order (empty if it holds none). Do not modify."""
        return self._owned.get(owner, [])

    def can_hold(self, owner, tokens: int) -> bool:
        return pages_for(tokens, self.page_size) - len(self.pages(owner)) <= len(self._free)

    def ensure(self, owner, tokens: int) -> bool:
        """Give ``owner`` pages for its first ``tokens`` tokens; False (and nothing allocated) if too few are free."""
        have = self._owned.get(owner, [])
        need = pages_for(tokens, self.page_size) - len(have)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        self._owned[owner] = have + [self._free.pop() for _ in range(need)]
        return True

    def release(self, owner) -> int:
        """Free every page of ``owner``; returns how many."""
        pages = self._owned.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def detach(self, owner, count: int) -> list[int]:
        """``owner``'s first ``count`` pages, no longer its own: the caller hands them to the radix tree
        (or frees them with ``free``)."""
        have = self._owned.get(owner, [])
        out, rest = have[:count], have[count:]
        if rest:
            self._owned[owner] = rest
        else:
            self._owned.pop(owner, None)
        return out

    def free(self, pages: list[int]) -> None:
        """Pages nobody holds any more (the radix tree's, or detached duplicates) back to the free list."""
        self._free.extend(reversed(pages))

    def shrink(self, owner, tokens: int) -> None:
        """Free ``owner``'s pages past its first ``tokens`` tokens (what it reserved and did not write)."""
        have = self._owned.get(owner, [])
        keep = pages_for(max(tokens, 0), self.page_size)
        if len(have) > keep:
            self.free(have[keep:])
            del have[keep:]
            if not have:
                del self._owned[owner]

    def owners(self) -> list:
        return list(self._owned)

    def check(self, elsewhere: list[int] = ()) -> None:
        """Every page is free, owned by exactly one owner, or in ``elsewhere`` (the radix tree's), once
        (AssertionError naming the first violation)."""
        owned = [p for ps in self._owned.values() for p in ps]
        assert len(set(owned)) == len(owned), "a page is owned twice"
        assert len(set(elsewhere)) == len(elsewhere), "the radix tree holds a page twice"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert not set(owned) & set(elsewhere), "a page is owned by a request and by the radix tree"
        assert not set(elsewhere) & set(self._free), "a page is both in the radix tree and free"
        assert len(owned) + len(elsewhere) + len(self._free) == self.capacity, (
            f"{len(owned)} owned + {len(elsewhere)} in the tree + {len(self._free)} free != {self.capacity} pages")


@dataclass(eq=False)
class KVHold:
    """The KV pages a running request (or an idle streaming session) reads, in token order: ``prefix``,
    the radix tree's pages of a page-aligned prefix (shared, never written; ``node`` is kv-locked while
    held), then its own pages, from the page boundary after the prefix: the allocator's, under this
    object as their owner (a hold passes from a session's turn to the session and back as it is)."""

    prefix: list[int] = field(default_factory=list)
    node: object | None = None  # radix_tree.TreeNode

"""KV page accounting for hybrid models' attention layers: which pages are free, which belong to whom.

Plain Python over page ids; the tensors are the engine's ``KVPool``. A page holds ``page_size``
consecutive tokens of one sequence in every attention layer; a sequence's pages, in order, are its
block table row. Token ``p`` of a sequence lives at ``pages[p // page_size] * page_size + p % page_size``.
"""

from __future__ import annotations


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

    def owners(self) -> list:
        return list(self._owned)

    def check(self) -> None:
        """Every page is free or owned by exactly one owner (AssertionError naming the first violation)."""
        owned = [p for ps in self._owned.values() for p in ps]
        assert len(set(owned)) == len(owned), "a page is owned twice"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert len(owned) + len(self._free) == self.capacity, (
            f"{len(owned)} owned + {len(self._free)} free != {self.capacity} pages")

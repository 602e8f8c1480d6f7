"""State slot accounting: which of the pool's slots are free. Plain Python; the tensors are the engine's."""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("the state pool needs at least one slot")
        self.capacity = capacity
        # LIFO: a just-freed slot is reused first (warm in cache).
        self._free = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"double free or foreign slot {slot}")
        self._used.remove(slot)
        self._free.append(slot)

    def used_slots(self) -> set[int]:
        return set(self._used)

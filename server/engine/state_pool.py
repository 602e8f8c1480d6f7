"""Recurrent state memory: one slot per request, cached snapshot or session (DESIGN §4).

``SlotAllocator`` is the accounting (plain Python, unit-testable); ``MambaStatePool`` adds the
tensors. Slot 0 is the padding slot: never allocated, the target of padded decode rows.
"""

from __future__ import annotations

import torch

PADDING_SLOT = 0


class SlotAllocator:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("the state pool needs at least one slot")
        self.capacity = capacity
        # LIFO: a just-freed slot is reused first (warm in cache).
        self._free = list(range(capacity, 0, -1))
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


class MambaStatePool:
    """``conv[L, S+1, conv_dim, K-1]`` and ``ssm[L, S+1, H, P, N]`` (+1: the padding slot)."""

    def __init__(self, num_layers: int, capacity: int, conv_dim: int, conv_kernel: int, num_heads: int,
                 head_dim: int, state_size: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device | str):
        self.allocator = SlotAllocator(capacity)
        self.conv = torch.zeros(num_layers, capacity + 1, conv_dim, conv_kernel - 1, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(num_layers, capacity + 1, num_heads, head_dim, state_size, dtype=ssm_dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size() + self.ssm[:, 0].numel() * self.ssm.element_size())

    @staticmethod
    def slot_bytes(num_layers, conv_dim, conv_kernel, num_heads, head_dim, state_size, conv_dtype, ssm_dtype) -> int:
        conv = num_layers * conv_dim * (conv_kernel - 1) * torch.empty(0, dtype=conv_dtype).element_size()
        ssm = num_layers * num_heads * head_dim * state_size * torch.empty(0, dtype=ssm_dtype).element_size()
        return conv + ssm

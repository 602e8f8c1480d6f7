"""The recurrent state tensors: one slot per running request, cached snapshot or session between turns.

Only the model runner (and the kernels it calls) reads or writes these tensors; which slot is whose
is the cache's ``SlotAllocator``.
"""

from __future__ import annotations

import math

import torch

from mambaserve.server.cache.slots import SlotAllocator


class MambaStatePool:
    """``conv[L, S, conv_dim, K-1]`` and ``ssm[L, S, H, P, N]`` for S slots; padded decode rows use slot -1."""

    def __init__(self, num_layers: int, capacity: int, conv_dim: int, conv_kernel: int, num_heads: int,
                 head_dim: int, state_size: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device | str):
        self.allocator = SlotAllocator(capacity)
        self.conv = torch.zeros(num_layers, capacity, conv_dim, conv_kernel - 1, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(num_layers, capacity, num_heads, head_dim, state_size, dtype=ssm_dtype, device=device)

    @classmethod
    def for_model(cls, model, capacity: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                  device: torch.device | str) -> MambaStatePool:
        """``capacity`` slots of ``model``'s states on this rank (``model.state_dims``)."""
        d = model.state_dims
        return cls(d.num_layers, capacity, d.conv_dim, d.conv_kernel, d.num_heads, d.head_dim, d.state_size,
                   conv_dtype, ssm_dtype, device)

    @property
    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """One slot's state, every layer: what ``ModelRunner.read_slot`` returns and ``write_slot`` takes."""
        return {"conv": tuple(self.conv[:, 0].shape), "ssm": tuple(self.ssm[:, 0].shape)}

    @property
    def bytes_per_slot(self) -> int:
        return self.state_bytes(self.slot_shapes)

    def state_bytes(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """One state of ``shapes`` (as ``slot_shapes``) in this pool's dtypes: a tensor-parallel rank's whole
        states (every rank's heads) are larger than its slots."""
        return math.prod(shapes["conv"]) * self.conv.element_size() + math.prod(shapes["ssm"]) * self.ssm.element_size()


class HostStatePool:
    """The host tier's states (``cache.host_tier``): ``conv[S, L, conv_dim, K-1]`` and ``ssm[S, L, H, P, N]``,
    slot-major so one slot is one contiguous block for its device copies; pinned on CUDA hosts so the
    copies run asynchronously (offloads on the model runner's copy stream, loads on the forward's)."""

    def __init__(self, device_pool: MambaStatePool, capacity: int, pin: bool,
                 shapes: dict[str, tuple[int, ...]] | None = None):
        """``shapes``: one slot's (``conv``, ``ssm``) when not the device pool's: a tensor-parallel server's host
        tier holds whole states (every rank's heads) on rank 0."""
        conv, ssm = device_pool.conv, device_pool.ssm
        shapes = shapes or device_pool.slot_shapes
        self.capacity = capacity
        self.conv = torch.zeros(capacity, *shapes["conv"], dtype=conv.dtype, pin_memory=pin)
        self.ssm = torch.zeros(capacity, *shapes["ssm"], dtype=ssm.dtype, pin_memory=pin)

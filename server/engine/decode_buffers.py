"""The static inputs of a decode step and the forward a decode CUDA graph captures over them.

A captured graph replays fixed addresses with fixed shapes, so every input of a decode step lives in a
buffer sized for the largest bucket: a step of ``n`` rows runs in the first ``b >= n`` rows, and the
``b - n`` padding rows carry slot ``-1`` (the Mamba kernels skip them). Hybrid models' attention layers
also need the paged KV view of the step; it is derived on the device, inside the captured forward, from
two buffers:

- ``view[0]``: each row's position (the new token's; RoPE), ``view[1]``: its KV length after the step
  (position + 1; 0 for a padding row: ``write_kv`` stores nothing at slot ``-1`` and the decode kernel reads
  nothing and returns zeros for it);
- ``block_table`` ``[rows, max_pages]``: each row's pages, in a table as wide as a context
  (``pages_for(context_length, page_size)``), so the decode kernel's grid and split count depend on the
  shapes only (``paged_attention.decode_splits``); entries past a row's pages hold whatever was there (the
  kernels never read past a row's length). A row is uploaded only when its pages change (between most
  decode steps none do);

and the new token's cache slot is ``block_table[r, pos // page_size] * page_size + pos % page_size``, a
gather: no host value and no data-dependent shape enters the graph. ``forward(b)`` runs on CPU as well,
which is how the tests compare it, padding rows included, with the eager path.
"""

from __future__ import annotations

import torch

from mambaserve.server.cache.pages import pages_for
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.sampling import to_device
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model.inputs import BatchTensors, ForwardMode


class DecodeBuffers:
    """Static decode inputs for up to ``rows`` rows; with ``kv_pool``, rows of up to ``context_length`` tokens."""

    def __init__(self, model, pool: MambaStatePool, rows: int, device: torch.device, kv_pool: KVPool | None = None,
                 context_length: int = 0):
        self.model, self.pool, self.kv_pool, self.device = model, pool, kv_pool, device
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        # constant per bucket: sliced, not rebuilt inside every replay
        self.zeros = torch.zeros(rows, dtype=torch.long, device=device)
        self.no_state = torch.zeros(rows, dtype=torch.bool, device=device)
        self.cu = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._uploaded_slots: tuple[int, list[int]] | None = None  # (bucket, slots) now in self.slots
        if kv_pool is not None:
            if context_length < 1:
                raise ValueError("decode buffers for a KV pool need the context length (the block table's width)")
            self.page_size = kv_pool.page_size
            self.max_pages = pages_for(context_length, self.page_size)
            self.view = torch.zeros(2, rows, dtype=torch.long, device=device)  # [0]: positions, [1]: KV lengths
            self.block_table = torch.zeros(rows, self.max_pages, dtype=torch.int32, device=device)
            self._table_rows: list[list[int] | None] = [None] * rows  # what each row of block_table holds

    @property
    def max_kv_tokens(self) -> int:
        """A row fits the block table while its KV length (position + 1) is at most this."""
        return self.max_pages * self.page_size if self.kv_pool is not None else 0

    def fits(self, start_pos: list[int]) -> bool:
        """Every row's new token lands inside the block table (a longer row runs eagerly)."""
        return self.kv_pool is None or not start_pos or max(start_pos) < self.max_kv_tokens

    def load(self, b: int, token_ids: torch.Tensor, slots: list[int], start_pos: list[int] = (),
             pages: list[list[int]] | None = None) -> None:
        """The static inputs of bucket ``b`` for these ``len(slots) <= b`` real rows (the rest padding):
        ``token_ids`` on the device; ``start_pos`` and ``pages`` as in ``ForwardBatch`` (hybrids). A row with
        slot -1 or no pages attends to nothing and writes no KV, as in the eager path."""
        n = len(slots)
        self.ids[:n].copy_(token_ids)
        if self._uploaded_slots != (b, slots):  # unchanged between most decode steps: skip the upload
            upload(self.slots[:b], list(slots) + [-1] * (b - n))
            self._uploaded_slots = (b, list(slots))
        if self.kv_pool is not None:
            self._load_kv(b, slots, start_pos, pages or [[] for _ in slots])

    def _load_kv(self, b: int, slots: list[int], start_pos: list[int], pages: list[list[int]]) -> None:
        ps, width = self.page_size, self.max_pages
        positions, lens, changed = [], [], []
        for r, (slot, pos, own) in enumerate(zip(slots, start_pos, pages)):
            if slot < 0 or not own:  # padding row: writes nothing, attends to nothing
                positions.append(0)
                lens.append(0)
                continue
            if len(own) * ps <= pos:
                raise ValueError(f"a sequence of {pos + 1} tokens has only {len(own)} pages of {ps}")
            if pos >= width * ps:
                raise ValueError(f"a row at position {pos} does not fit the decode block table ({width} pages of "
                                 f"{ps}): run it eagerly")
            positions.append(pos)
            lens.append(pos + 1)
            if self._table_rows[r] != own:
                changed.append((r, list(own)))
        pad = b - len(slots)
        upload(self.view[:, :b], [positions + [0] * pad, lens + [0] * pad])
        if changed:
            # entries past a row's pages are never read (the kernels stop at its length; pages past the width
            # are past every length that runs here): the changed rows go up padded to the longest of them only
            w = min(width, max(len(own) for _, own in changed))
            rows = [own[:w] + [0] * (w - len(own)) for _, own in changed]
            self.block_table[:, :w].index_copy_(0, to_device([r for r, _ in changed], torch.long, self.device),
                                                to_device(rows, torch.int32, self.device))
            for r, own in changed:  # only now: a refused batch above leaves the record as the table is
                self._table_rows[r] = own

    def forward(self, b: int) -> torch.Tensor:
        """The model on the first ``b`` rows of the buffers: logits ``[b, V]``. What a decode graph captures:
        every shape depends on ``b`` (and the buffers' sizes) alone, nothing reads a value back to the host."""
        bt = BatchTensors(mode=ForwardMode.DECODE, cu_seqlens=self.cu[:b + 1], slots=self.slots[:b],
                          has_initial_state=self.no_state[:b], start_pos=self.zeros[:b])
        if self.kv_pool is None:
            return self.model(self.ids[:b], bt, self.pool.conv, self.pool.ssm, None)[0]
        ps = self.page_size
        pos, lens, table = self.view[0, :b], self.view[1, :b], self.block_table[:b]
        page = table.gather(1, (pos // ps)[:, None])[:, 0].long()
        bt.positions = pos
        bt.slot_mapping = torch.where(lens > 0, page * ps + pos % ps, -1)
        bt.kv_lens = lens.to(torch.int32)
        bt.block_table = table
        return self.model(self.ids[:b], bt, self.pool.conv, self.pool.ssm, None,
                          kv=(self.kv_pool.k, self.kv_pool.v))[0]


def upload(dst: torch.Tensor, values: list) -> None:
    """``dst[...] = values`` without a stream synchronisation (through pinned memory on CUDA)."""
    src = torch.tensor(values, dtype=dst.dtype)
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)

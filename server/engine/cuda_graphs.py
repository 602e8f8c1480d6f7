"""Decode under CUDA graphs: one graph per batch-size bucket, replayed with padded rows.

Decode is launch-bound at small batch (dozens of kernels per layer, each a few µs of work), so the
whole decode forward is captured once per bucket and replayed. Padded rows carry slot ``-1``: the
state kernels skip them, so no slot is touched. Inputs are copied into static buffers before replay, the
slots only when they changed since the last replay (between most decode steps they do not).
"""

from __future__ import annotations

import logging

import torch

from mambaserve.server.model.inputs import BatchTensors, ForwardMode
from mambaserve.server.model.mamba2 import Mamba2ForCausalLM
from mambaserve.server.engine.state_pool import MambaStatePool

log = logging.getLogger(__name__)


def buckets_up_to(n: int) -> list[int]:
    out = [1, 2, 4, 8, 16, 24, 32]
    while out[-1] < n:
        out.append(out[-1] + (16 if out[-1] < 128 else 32))
    return [b for b in out if b < n] + [n]


class DecodeGraphs:
    def __init__(self, model: Mamba2ForCausalLM, pool: MambaStatePool, max_batch: int, device: torch.device):
        self.model, self.pool, self.device = model, pool, device
        self.buckets = buckets_up_to(max_batch)
        bmax = self.buckets[-1]
        self.ids = torch.zeros(bmax, dtype=torch.long, device=device)
        self.slots = torch.full((bmax,), -1, dtype=torch.long, device=device)
        self._uploaded: tuple[int, list[int]] | None = None  # (bucket, slots) now in self.slots
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _bt(self, b: int) -> BatchTensors:
        z = torch.zeros(b, dtype=torch.long, device=self.device)
        return BatchTensors(mode=ForwardMode.DECODE, cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=self.device),
                            slots=self.slots[:b], has_initial_state=z.bool(), start_pos=z)

    @torch.inference_mode()
    def capture(self) -> None:
        pool_handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                bt = self._bt(b)
                for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                    self.model(self.ids[:b], bt, self.pool.conv, self.pool.ssm, None)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool_handle, stream=stream):
                    self.outputs[b], _ = self.model(self.ids[:b], bt, self.pool.conv, self.pool.ssm, None)
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, token_ids: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """``token_ids`` on the device (some are the previous step's samples, never seen by the host)."""
        n = len(slots)
        b = next(x for x in self.buckets if x >= n)
        self.ids[:n].copy_(token_ids)
        if self._uploaded != (b, slots):  # unchanged between most decode steps: skip the upload
            self.slots[:n].copy_(torch.tensor(slots, dtype=torch.long).pin_memory(), non_blocking=True)
            if b > n:
                self.slots[n:b].fill_(-1)
            self._uploaded = (b, list(slots))
        self.graphs[b].replay()
        return self.outputs[b][:n].clone()  # the static buffer is overwritten by the next replay

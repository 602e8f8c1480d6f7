"""Runs one ForwardBatch: deferred state ops first, then the model.

The only place (with the kernels) that touches the state pool's tensors. Nothing here waits for the
device (host data goes up through pinned memory): the scheduler prepares the next step while this
one runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve import kernels
from mambaserve.server.forward_batch import ForwardBatch, ForwardMode, StateOps
from mambaserve.server.mamba2_model import BatchTensors, Mamba2ForCausalLM
from mambaserve.server.sampling import to_device
from mambaserve.server.state_pool import MambaStatePool


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [S, V] (last token of each sequence) or [T, V] with all_logits; fp32


class ModelRunner:
    def __init__(self, model: Mamba2ForCausalLM, pool: MambaStatePool, device: torch.device):
        self.model, self.pool, self.device = model, pool, device
        self.graphs = None

    def enable_cuda_graphs(self, max_batch: int) -> None:
        from mambaserve.server.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.pool, max_batch, self.device)
        self.graphs.capture()

    def apply_state_ops(self, ops: StateOps) -> None:
        if ops.copies:
            src = to_device([s for s, _ in ops.copies], torch.long, self.device)
            dst = to_device([d for _, d in ops.copies], torch.long, self.device)
            kernels.copy_slots(self.pool.conv, src, dst)
            kernels.copy_slots(self.pool.ssm, src, dst)
        if ops.clears:
            idx = to_device(ops.clears, torch.long, self.device)
            kernels.clear_slots(self.pool.conv, idx)
            kernels.clear_slots(self.pool.ssm, idx)

    def _token_ids(self, batch: ForwardBatch) -> torch.Tensor:
        ids = to_device(batch.token_ids, torch.long, self.device)
        if batch.from_prev:
            pos, rows = zip(*batch.from_prev)
            ids[to_device(pos, torch.long, self.device)] = batch.prev_tokens[to_device(rows, torch.long, self.device)]
        return ids

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.apply_state_ops(batch.state_ops)
        ids = self._token_ids(batch)
        if self.graphs is not None and batch.mode is ForwardMode.DECODE and batch.batch_size <= self.graphs.buckets[-1]:
            return ForwardOutput(logits=self.graphs.run(ids, batch.slots))
        dev = self.device
        cu = [0]
        for n in batch.seq_lens:
            cu.append(cu[-1] + n)
        bt = BatchTensors(
            mode=batch.mode,
            cu_seqlens=to_device(cu, torch.int32, dev),
            slots=to_device(batch.slots, torch.long, dev),
            has_initial_state=to_device(batch.has_initial_state, torch.bool, dev),
            start_pos=to_device(batch.start_pos, torch.long, dev),
            track=[(i, pos) for i, pos, _ in batch.track],
            host_cu=cu,
            host_start=list(batch.start_pos),
        )
        rows = None
        if batch.mode is ForwardMode.EXTEND and not batch.all_logits:
            rows = to_device([c - 1 for c in cu[1:]], torch.long, dev)
        logits, tracked = self.model(ids, bt, self.pool.conv, self.pool.ssm, rows)
        if batch.track:  # tracked states into their snapshot slots, all layers at once
            dst = to_device([slot for _, _, slot in batch.track], torch.long, dev)
            self.pool.conv[:, dst] = torch.stack([c for c, _ in tracked]).to(self.pool.conv.dtype)
            self.pool.ssm[:, dst] = torch.stack([s for _, s in tracked]).to(self.pool.ssm.dtype)
        return ForwardOutput(logits=logits)

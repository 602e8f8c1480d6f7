"""Runs one ForwardBatch: deferred state ops first, then the model, then sampling.

The only place (with the kernels) that touches the state pool's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve import kernels
from mambaserve.server.forward_batch import ForwardBatch, ForwardMode, StateOps
from mambaserve.server.mamba2_model import BatchTensors, Mamba2ForCausalLM
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
            src = torch.tensor([s for s, _ in ops.copies], device=self.device)
            dst = torch.tensor([d for _, d in ops.copies], device=self.device)
            kernels.copy_slots(self.pool.conv, src, dst)
            kernels.copy_slots(self.pool.ssm, src, dst)
        if ops.clears:
            idx = torch.tensor(ops.clears, device=self.device)
            kernels.clear_slots(self.pool.conv, idx)
            kernels.clear_slots(self.pool.ssm, idx)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.apply_state_ops(batch.state_ops)
        if self.graphs is not None and batch.mode is ForwardMode.DECODE and batch.batch_size <= self.graphs.buckets[-1]:
            return ForwardOutput(logits=self.graphs.run(batch.token_ids, batch.slots))
        dev = self.device
        lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        bt = BatchTensors(
            mode=batch.mode,
            cu_seqlens=cu.to(dev),
            slots=torch.tensor(batch.slots, dtype=torch.long, device=dev),
            has_initial_state=torch.tensor(batch.has_initial_state, dtype=torch.bool, device=dev),
            start_pos=torch.tensor(batch.start_pos, dtype=torch.long, device=dev),
            track=[(i, pos) for i, pos, _ in batch.track],
            host_cu=cu.tolist(),
            host_start=list(batch.start_pos),
        )
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        rows = None
        if batch.mode is ForwardMode.EXTEND and not batch.all_logits:
            rows = (cu[1:] - 1).to(dev, torch.long)
        logits, tracked = self.model(ids, bt, self.pool.conv, self.pool.ssm, rows)
        if batch.track:  # tracked states into their snapshot slots, all layers at once
            dst = torch.tensor([slot for _, _, slot in batch.track], device=dev)
            self.pool.conv[:, dst] = torch.stack([c for c, _ in tracked]).to(self.pool.conv.dtype)
            self.pool.ssm[:, dst] = torch.stack([s for _, s in tracked]).to(self.pool.ssm.dtype)
        return ForwardOutput(logits=logits)

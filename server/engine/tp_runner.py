"""Tensor parallelism on the engine's side: rank 0 leads, the other ranks follow its steps.

The scheduler, the radix tree, sessions and every decision live on rank 0; its model runner is a
``LeaderRunner``, which sends each command that touches device state (a step's ``ForwardBatch`` with its
state ops, state ops alone, a slot read out or written, the warm-up's kernels and graphs) down the command
channel (``ranks.Ranks.send``) before running it itself. Every follower runs ``follow``: the same commands,
in the same order, on its own ``ModelRunner`` over its shard of the model and of every pool, so the
collectives inside the forwards match. The tokens a decode step takes from the previous step's samples
(``ForwardBatch.from_prev``: sampled on rank 0, never seen by its host) go to the followers by a device
broadcast in the step's stream, so overlap scheduling holds at any TP size.

A slot's state read out (session snapshots) is gathered to rank 0 into the layout one device holds, and a
state written into a slot is cut into the ranks' parts from that layout (``parallel.shard_state``): files
hold the same bytes at any TP size.

A command that fails on any rank once sent leaves the ranks out of step (a collective one of them never
reaches): it ends the server (``ranks.fatal``) rather than let it hang or serve wrong values.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mambaserve.server.cache.prefix_cache import StateOps
from mambaserve.server.engine.batch import ForwardBatch
from mambaserve.server.engine.model_runner import ForwardOutput, ModelRunner
from mambaserve.server.engine.ranks import Ranks, fatal
from mambaserve.server.model.parallel import TP, merge_state, shard_state

log = logging.getLogger(__name__)


class LeaderRunner(ModelRunner):
    """Rank 0's model runner: every command goes to the followers first (module docstring)."""

    def __init__(self, model, pool, device: torch.device, kv_pool, ranks: Ranks):
        super().__init__(model, pool, device, kv_pool)
        self.ranks, self.tp = ranks, ranks.tp
        self.full = model.mixers()[0].shard.full  # the Mamba layers' dims on one device (files' state layout)

    @property
    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.full
        return {"conv": (d.num_layers, d.conv_dim, d.conv_kernel - 1),
                "ssm": (d.num_layers, d.num_heads, d.head_dim, d.state_size)}

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        prev = None
        if batch.from_prev:
            prev = (tuple(batch.prev_tokens.shape), batch.prev_tokens.dtype)
        self.ranks.send(("forward", dataclasses.replace(batch, state_ops=StateOps(list(batch.state_ops.ops)),
                                                        prev_tokens=None), prev))
        return self._in_step("a forward", lambda: self._forward(batch, prev))

    def _forward(self, batch: ForwardBatch, prev) -> ForwardOutput:
        if prev is not None:
            dist.broadcast(batch.prev_tokens, 0, group=self.tp.group)
        return super().forward(batch)

    def apply_state_ops(self, ops: StateOps) -> None:
        self.ranks.send(("ops", list(ops.ops)))
        self._in_step("state ops", lambda: super(LeaderRunner, self).apply_state_ops(ops))

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's state gathered from every rank, in the layout one device holds."""
        self.ranks.send(("read", slot))
        return self._in_step("a state read", lambda: gather_slot(self, slot, self.tp, self.full))

    def write_slot(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        """``state`` (the layout one device holds) cut into the ranks' parts and written into their slot."""
        self.ranks.send(("write", slot))
        self._in_step("a state write", lambda: scatter_slot(self, slot, state, self.tp, self.full))

    def copy_out(self, slot: int, kv=None):
        raise NotImplementedError("a slot copied out for the storage tier at --tensor-parallel-size > 1 (refused at "
                                  "start: Engine's tp_refusals)")

    load_in = copy_out

    def enable_cuda_graphs(self, *args) -> None:
        self.ranks.send(("graphs", args))
        self._in_step("the CUDA graphs' capture", lambda: super(LeaderRunner, self).enable_cuda_graphs(*args))

    def warm_up_kernels(self, max_tokens: int) -> int:
        self.ranks.send(("warm_up_kernels", max_tokens))
        return super().warm_up_kernels(max_tokens)

    def _in_step(self, what: str, fn):
        try:
            return fn()
        except Exception:
            if gone := self.ranks.ended(wait=2.0):  # (a collective fails when a rank is gone)
                fatal(gone)
            log.exception("rank 0 failed in %s", what)
            fatal(f"tensor parallel: rank 0 failed in {what} after its followers were sent it; the ranks are out "
                  "of step, so the server stops")


def gather_slot(runner: ModelRunner, slot: int, tp: TP, full) -> dict[str, torch.Tensor] | None:
    """Every rank's part of ``slot``'s state to rank 0, merged there into one device's layout of the Mamba
    layers ``full`` (None on the other ranks)."""
    local = ModelRunner.read_slot(runner, slot)
    parts = {}
    for name, t in local.items():
        bufs = [torch.empty_like(t) for _ in range(tp.size)] if tp.rank == 0 else None
        dist.gather(t, bufs, dst=0, group=tp.group)
        parts[name] = bufs
    if tp.rank:
        return None
    return merge_state([{k: parts[k][r] for k in parts} for r in range(tp.size)], full)


def scatter_slot(runner: ModelRunner, slot: int, state: dict[str, torch.Tensor] | None, tp: TP, full) -> None:
    """Rank 0's ``state`` (one device's layout) cut into the ranks' parts; each writes its own into ``slot``."""
    pool = runner.pool
    local = {"conv": torch.empty(pool.conv[:, slot].shape, dtype=pool.conv.dtype, device=pool.conv.device),
             "ssm": torch.empty(pool.ssm[:, slot].shape, dtype=pool.ssm.dtype, device=pool.ssm.device)}
    shards = None
    if tp.rank == 0:
        state = {k: v.to(local[k].device, local[k].dtype) for k, v in state.items()}
        shards = shard_state(state, full, tp.size)
    for name, t in local.items():
        dist.scatter(t, [s[name] for s in shards] if shards else None, src=0, group=tp.group)
    ModelRunner.write_slot(runner, slot, local)


def follow(runner: ModelRunner, conn, tp: TP) -> None:
    """A follower's loop: the leader's commands, in order, until it says stop (or its channel ends)."""
    full = runner.model.mixers()[0].shard.full
    while True:
        try:
            command = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            fatal(f"tensor-parallel rank {tp.rank}: the leader's command channel closed; exiting")
        kind, args = command[0], command[1:]
        if kind == "stop":
            return
        try:
            if kind == "forward":
                batch, prev = args
                if prev is not None:
                    batch.prev_tokens = torch.empty(prev[0], dtype=prev[1], device=runner.device)
                    dist.broadcast(batch.prev_tokens, 0, group=tp.group)
                runner.forward(batch)
            elif kind == "ops":
                runner.apply_state_ops(StateOps(args[0]))
            elif kind == "read":
                gather_slot(runner, args[0], tp, full)
            elif kind == "write":
                scatter_slot(runner, args[0], None, tp, full)
            elif kind == "graphs":
                runner.enable_cuda_graphs(*args[0])
            elif kind == "warm_up_kernels":
                runner.warm_up_kernels(args[0])
            else:
                raise ValueError(f"unknown command {kind!r}")
        except Exception:
            log.exception("tensor-parallel rank %d failed in %r", tp.rank, kind)
            fatal(f"tensor-parallel rank {tp.rank} failed in {kind!r}: the ranks are out of step; exiting")


def main() -> None:
    """A follower process (``Ranks.start`` runs it): join the leader, load this rank's shard and pools, follow."""
    from mambaserve.kernels import compiles
    from mambaserve.server.engine import ranks
    from mambaserve.server.engine.pools import build_pools
    from mambaserve.server.model.config import read_config
    from mambaserve.server.model.loader import load_model, resolve_device, resolve_dtype
    from mambaserve.server.model.registry import resolve

    rank = int(sys.argv[1])
    conn, cfg, context_length, size, store_port = ranks.join(rank)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    if cfg.kernel_cache_dir:
        compiles.set_cache_dir(cfg.kernel_cache_dir)
    device = ranks.rank_device(resolve_device(cfg.device), rank)
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp = ranks.init_group(rank, size, device, store_port)
    dtype = resolve_dtype(cfg.dtype, device)
    model, _ = load_model(cfg.model, dtype, device, tp=tp)
    hybrid = resolve(read_config(Path(cfg.model))).hybrid
    pools = build_pools(cfg, model, device, dtype, context_length, hybrid, tp)
    runner = ModelRunner(model, pools.pool, device, pools.kv_pool)
    runner.host_pool = pools.host_pool
    log.info("rank %d ready: following rank 0", rank)
    follow(runner, conn, tp)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tensor parallelism on the engine's side: rank 0 leads, the other ranks follow its steps.

The scheduler, the radix tree, sessions and every decision live on rank 0; its model runner is a
``LeaderRunner``, which sends each command that touches device state (a step's ``ForwardBatch`` with its
state ops, state ops alone, a slot read out or written, the warm-up's kernels and graphs) down the command
channel (``ranks.Ranks.send``) before running it itself. Every follower runs ``follow``: the same commands,
in the same order, on its own ``ModelRunner`` over its shard of the model and of every pool, so the
collectives inside the forwards match. The tokens a decode step takes from the previous step's samples
(``ForwardBatch.from_prev``: sampled on rank 0, never seen by its host) go to the followers by a device
broadcast in the step's stream, so overlap scheduling holds at any TP size.

A slot's state read out (session snapshots) or offloaded to the host tier is gathered to rank 0 into the
layout one device holds, and a state written into a slot or loaded from the host tier is cut into the ranks'
parts from that layout (``parallel.shard_state``): files, the host tier (on rank 0 alone) and the storage tier
hold the same bytes at any TP size, and the tiers' bookkeeping runs on rank 0 as at TP 1.

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
from mambaserve.server.model.parallel import TP, merge_state, shard_state, slot_shapes

log = logging.getLogger(__name__)


class ShardedRunner(ModelRunner):
    """A rank's model runner over its shard: a slot's state read out, written, offloaded to the host tier or
    loaded from it moves between the ranks' parts and one device's layout (``read_slot`` / ``write_slot``),
    so that files, the host tier (rank 0's alone, whole states) and the storage tier hold the same bytes at any
    TP size. Every rank runs these together (their collectives match)."""

    def __init__(self, model, pool, device: torch.device, kv_pool, tp: TP):
        super().__init__(model, pool, device, kv_pool)
        self.tp = tp
        self.full = model.mixers()[0].shard.full  # the Mamba layers' dims on one device

    @property
    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        return slot_shapes(self.full)

    @property
    def slot_bytes(self) -> int:
        return self.pool.state_bytes(self.slot_shapes)

    def read_slot(self, slot: int) -> dict[str, torch.Tensor] | None:
        """The slot's state gathered from every rank, in the layout one device holds (on rank 0; None elsewhere)."""
        tp, parts = self.tp, {}
        for name, t in super().read_slot(slot).items():
            parts[name] = [torch.empty_like(t) for _ in range(tp.size)] if tp.rank == 0 else None
            dist.gather(t, parts[name], dst=0, group=tp.group)
        if tp.rank:
            return None
        return merge_state([{k: parts[k][r] for k in parts} for r in range(tp.size)], self.full)

    def write_slot(self, slot: int, state: dict[str, torch.Tensor] | None) -> None:
        """Rank 0's ``state`` (one device's layout) cut into the ranks' parts, each written into ``slot``."""
        pool, shards = self.pool, None
        local = {"conv": torch.empty(pool.conv[:, slot].shape, dtype=pool.conv.dtype, device=pool.conv.device),
                 "ssm": torch.empty(pool.ssm[:, slot].shape, dtype=pool.ssm.dtype, device=pool.ssm.device)}
        if self.tp.rank == 0:
            state = {k: v.to(local[k].device, local[k].dtype, non_blocking=True) for k, v in state.items()}
            shards = shard_state(state, self.full, self.tp.size)
        for name, t in local.items():
            dist.scatter(t, [s[name] for s in shards] if shards else None, src=0, group=self.tp.group)
        super().write_slot(slot, local)

    def _offload(self, pairs: list[tuple[int, int]]) -> None:
        # on the forward stream (the gather is a collective in step with the forwards'), into rank 0's host slot
        for slot, h in pairs:
            state = ShardedRunner.read_slot(self, slot)  # (a part of the command running: nothing more to send)
            if state is not None:
                self.host_pool.conv[h].copy_(state["conv"], non_blocking=True)
                self.host_pool.ssm[h].copy_(state["ssm"], non_blocking=True)

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        for h, slot in pairs:
            ShardedRunner.write_slot(self, slot, {"conv": self.host_pool.conv[h], "ssm": self.host_pool.ssm[h]}
                                     if self.tp.rank == 0 else None)


class LeaderRunner(ShardedRunner):
    """Rank 0's model runner: every command goes to the followers first (module docstring)."""

    def __init__(self, model, pool, device: torch.device, kv_pool, ranks: Ranks):
        super().__init__(model, pool, device, kv_pool, ranks.tp)
        self.ranks = ranks

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
        self.ranks.send(("read", slot))
        return self._in_step("a state read", lambda: super(LeaderRunner, self).read_slot(slot))

    def write_slot(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        self.ranks.send(("write", slot))
        self._in_step("a state write", lambda: super(LeaderRunner, self).write_slot(slot, state))

    def copy_out(self, slot: int, kv=None) -> tuple[dict, object]:
        """As ``ModelRunner.copy_out``, for a Mamba2 model's state (gathered from the ranks, then copied to the
        host after everything launched so far)."""
        if kv is not None:
            raise NotImplementedError("a hybrid's KV copied out at --tensor-parallel-size > 1")
        state = self.read_slot(slot)
        pin = self.device.type == "cuda"
        out = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}
        for k, v in state.items():
            out[k].copy_(v, non_blocking=pin)
        return out, self.fence()

    def load_in(self, slot: int, state: dict, table: list[int] | None = None) -> None:
        if table is not None and "k" in state:
            raise NotImplementedError("a hybrid's KV loaded in at --tensor-parallel-size > 1")
        self.write_slot(slot, {"conv": state["conv"], "ssm": state["ssm"]})

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


def follow(runner: ShardedRunner, conn) -> None:
    """A follower's loop: the leader's commands, in order, until it says stop (or its channel ends)."""
    tp = runner.tp
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
                runner.read_slot(args[0])
            elif kind == "write":
                runner.write_slot(args[0], None)
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
    runner = ShardedRunner(model, pools.pool, device, pools.kv_pool, tp)
    runner.host_pool = pools.host_pool
    log.info("rank %d ready: following rank 0", rank)
    follow(runner, conn)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The pools one rank holds, sized from its memory (``memory.py``'s arithmetic): the state pool's slots, a
hybrid's KV pages, the host tier's slots.

Every rank of a tensor-parallel server holds the same slots and pages (the scheduler on rank 0 hands out ids
that every rank's pools must have), each with its heads' part of every state and page; so the ranks plan
from the same numbers: the smallest device and the most memory in use among them (``TP.max_over_ranks``).
The host tier is rank 0's alone, of whole states.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.cuda_graphs import buckets_up_to, prefill_buckets
from mambaserve.server.engine.kv_pool import KVPool, page_bytes
from mambaserve.server.engine.memory import (HybridPlan, PoolPlan, decode_graph_bytes, device_memory, plan_hybrid,
                                             plan_pool, prefill_graph_bytes, reserve_bytes, slot_bytes)
from mambaserve.server.engine.state_pool import HostStatePool, MambaStatePool
from mambaserve.server.model.inputs import ForwardMode
from mambaserve.server.model.loader import DTYPES
from mambaserve.server.model.parallel import TP, slot_shapes

log = logging.getLogger(__name__)

STAGING_SNAPSHOTS = 8  # host tier for a storage tier given no --host-cache-size (1.4 GB at the 2.7b shape)


@dataclass
class Pools:
    plan: PoolPlan | HybridPlan
    pool: MambaStatePool
    kv_pool: KVPool | None
    host_pool: HostStatePool | None


def build_pools(cfg: ServerConfig, model, device: torch.device, dtype: torch.dtype, context_length: int,
                hybrid: bool, tp: TP) -> Pools:
    """``model``'s pools on ``device`` (this rank's heads of every state and page), sized as the flags and the
    memory left after the weights allow."""
    is_cuda = device.type == "cuda"
    total, in_use = device_memory(device)
    neg_total, in_use = tp.max_over_ranks([-total, in_use])  # the smallest device, the fullest
    total = -neg_total
    plan = (_plan_hybrid(cfg, model, dtype, context_length, is_cuda, total, in_use) if hybrid
            else _plan_pool(cfg, model, dtype, is_cuda, total, in_use))
    pool = MambaStatePool.for_model(model, plan.slots, dtype, DTYPES[cfg.state_dtype], device)
    kv_pool = None
    if hybrid and model.attention_dims is not None:
        kv_pool = KVPool.for_model(model, plan.pages, cfg.page_size, dtype, device)
        log.info("KV pool: %d pages x %d tokens x %.3f MiB = %.2f GiB", plan.pages, cfg.page_size,
                 plan.bytes_per_page / 2**20, plan.pages * plan.bytes_per_page / 2**30)
    shapes = slot_shapes(model.mixers()[0].shard.full)  # (a host slot holds a whole state: every rank's heads)
    return Pools(plan, pool, kv_pool, _host_pool(cfg, pool, is_cuda, shapes) if tp.rank == 0 else None)


def _plan_pool(cfg: ServerConfig, model, dtype: torch.dtype, is_cuda: bool, total: int, in_use: int) -> PoolPlan:
    """State slots and the running limit from the memory left after the weights (engine/memory.py)."""
    d, vocab = model.state_dims, model.dims.vocab_size  # (every rank's logits are the whole vocabulary's)
    default_running = 256 if is_cuda else 64
    per = slot_bytes(d.num_layers, d.conv_dim, d.conv_kernel, d.num_heads, d.head_dim, d.state_size, dtype,
                     DTYPES[cfg.state_dtype])
    reserve = reserve_bytes(d.d_inner + d.conv_dim + d.num_heads, d.num_heads, d.head_dim, d.state_size, vocab,
                            cfg.chunked_prefill_size, cfg.max_running_requests or default_running, dtype,
                            graphs=is_cuda and not cfg.disable_cuda_graph)
    return plan_pool(total=total, in_use=in_use, fraction=cfg.mem_fraction_static, per_slot=per, reserve=reserve,
                     slots=cfg.mamba_cache_size, running=cfg.max_running_requests, default_running=default_running)


def _plan_hybrid(cfg: ServerConfig, model, dtype: torch.dtype, context_length: int, is_cuda: bool, total: int,
                 in_use: int) -> HybridPlan:
    """State slots, KV pages and the running limit from the memory left after the weights."""
    d, s, a = model.dims, model.state_dims, model.attention_dims
    default_running = 256 if is_cuda else 64
    per_slot = slot_bytes(s.num_layers, s.conv_dim, s.conv_kernel, s.num_heads, s.head_dim, s.state_size,
                          dtype, DTYPES[cfg.state_dtype])
    per_page = (page_bytes(len(d.attention_layers), cfg.page_size, a.num_kv_heads, a.head_dim, dtype) if a else 1)
    widest = max(s.d_inner + s.conv_dim + s.num_heads, 2 * d.mlp.intermediate_size if d.mlp else 0,
                 2 * d.moe.intermediate_size * d.moe.top_k if d.moe else 0)
    running = cfg.max_running_requests or default_running
    graphs = is_cuda and not cfg.disable_cuda_graph
    prefill_graphs = graphs and model.capture_blocker(ForwardMode.EXTEND) is None
    reserve = reserve_bytes(widest, s.num_heads, s.head_dim, s.state_size, d.vocab_size, cfg.chunked_prefill_size,
                            running, dtype, graphs=prefill_graphs)
    if graphs and model.capture_blocker(ForwardMode.DECODE) is None:
        reserve += decode_graph_bytes(buckets_up_to(min(running, cfg.cuda_graph_max_bs)), d.vocab_size)
    if prefill_graphs:
        reserve += prefill_graph_bytes(prefill_buckets(cfg.chunked_prefill_size, running), d.vocab_size)
    return plan_hybrid(total=total, in_use=in_use, fraction=cfg.mem_fraction_static, per_slot=per_slot,
                       per_page=per_page, reserve=reserve, page_size=cfg.page_size, context_length=context_length,
                       slots=cfg.mamba_cache_size, running=cfg.max_running_requests, default_running=default_running,
                       pages=-(-cfg.max_total_tokens // cfg.page_size) if cfg.max_total_tokens else None,
                       cached=not cfg.disable_radix_cache)


def _host_pool(cfg: ServerConfig, pool: MambaStatePool, is_cuda: bool,
               shapes: dict[str, tuple[int, ...]]) -> HostStatePool | None:
    """The host tier's pool: ``--host-cache-size`` bytes in whole snapshots (none without a radix cache); with
    several ranks, on rank 0 alone, each snapshot whole (``shapes``: every rank's heads, gathered on offload and
    cut again on load, ``tp_runner.ShardedRunner``), so the storage tier works on rank 0 as with one. The storage
    tier moves every byte through it: with ``--storage-dir`` and no host size, a host tier of STAGING_SNAPSHOTS
    snapshots is its staging area."""
    per = pool.state_bytes(shapes)
    size = cfg.host_cache_size
    if not size and cfg.storage_dir and not cfg.disable_radix_cache:
        size = STAGING_SNAPSHOTS * per
        log.info("--storage-dir without --host-cache-size: a host tier of %d snapshots stages its reads and "
                 "writes", STAGING_SNAPSHOTS)
    if not size or cfg.disable_radix_cache:
        return None
    if size < per:
        raise ValueError(f"--host-cache-size {size} bytes holds no snapshot: one takes {per} bytes here")
    host = HostStatePool(pool, size // per, pin=is_cuda, shapes=shapes)
    log.info("host cache tier: %d snapshots x %.2f MiB (%s)", host.capacity, per / 2**20,
             "pinned" if is_cuda else "host memory")
    return host

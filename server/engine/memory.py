"""How many state slots and running requests fit: the state pool sized from memory, as arithmetic.

``--mem-fraction-static`` is the share of the device's memory (host RAM on CPU) this server may hold
in all: weights, the state pool, CUDA graphs and activations. Measured after the weights are loaded::

    pool budget = fraction x total - in use now (weights, CUDA context, other processes) - reserve

where the reserve covers what is allocated after the pool: activations of the largest prefill step
(``--chunked-prefill-size`` tokens through in_proj and the scan's buffers), the prefill and decode
CUDA graphs' private memory (about as much again), and the logits of a full decode batch. The pool gets
``budget // bytes per slot`` slots, at most 4 per running request (more only serves the cache, and a
bounded pool keeps the first start fast); an explicit ``--mamba-cache-size`` that does not fit is
refused with the numbers. Running requests default to at most three quarters of the slots, so the
radix cache and sessions keep room, and never exceed the slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GiB = 2**30
RESERVE_FLOOR = GiB // 2  # allocator slack, cuBLAS workspaces, sampling buffers


@dataclass(frozen=True)
class PoolPlan:
    slots: int
    max_running: int
    bytes_per_slot: int
    budget: int  # bytes the pool could have had


def slot_bytes(num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int, state_size: int,
               conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """One slot, every layer: the conv window (K - 1 inputs of conv_dim channels) and the SSM state."""
    conv = conv_dim * (conv_kernel - 1) * conv_dtype.itemsize
    ssm = num_heads * head_dim * state_size * ssm_dtype.itemsize
    return num_layers * (conv + ssm)


def reserve_bytes(in_proj_width: int, num_heads: int, head_dim: int, state_size: int, vocab_size: int,
                  chunk_tokens: int, max_running: int, dtype: torch.dtype, graphs: bool) -> int:
    """Memory allocated after the pool: one prefill step's activations (in_proj's output and a few
    buffers of its size, the scan's per-chunk start states), as much again for the graphs' memory, and
    a decode batch's logits and the sampler's fp32 copy of them."""
    step = 6 * chunk_tokens * in_proj_width * dtype.itemsize
    step += (chunk_tokens // 64 + 2 * max_running) * num_heads * head_dim * state_size * dtype.itemsize
    logits = 2 * max_running * vocab_size * 4
    return RESERVE_FLOOR + step * (2 if graphs else 1) + logits


def decode_graph_bytes(buckets: list[int], vocab_size: int) -> int:
    """What decode CUDA graphs keep after capture beyond the reserve's activations: every bucket's logits
    (counted as fp32, a margin for bf16 models), its static output (the activations between share one pool).
    1447 rows for buckets up to 256: at a 131072-token vocabulary 0.7 GiB."""
    return sum(buckets) * vocab_size * 4


def prefill_graph_bytes(buckets: list[tuple[int, int]], vocab_size: int) -> int:
    """What prefill CUDA graphs keep after capture beyond the reserve's activations: every (sequences, tokens)
    bucket's logits of its sequences' last tokens (counted as fp32). Buckets up to 33 sequences x 2048
    tokens at a 131072-token vocabulary: 0.4 GiB."""
    return sum(s for s, _ in buckets) * vocab_size * 4


def plan_pool(*, total: int, in_use: int, fraction: float, per_slot: int, reserve: int, slots: int | None,
              running: int | None, default_running: int) -> PoolPlan:
    """The pool's slots and the running limit (``slots``/``running``: explicit flags, else None). Raises
    ValueError, one line with the numbers, when the explicit values cannot fit."""
    budget = int(fraction * total) - in_use - reserve
    fits = max(0, budget // per_slot)
    how = (f"{fraction:g} x {total / GiB:.1f} GiB (--mem-fraction-static) - {in_use / GiB:.1f} GiB in use "
           f"- {reserve / GiB:.1f} GiB reserved for activations and graphs = {max(budget, 0) / GiB:.1f} GiB")
    if slots is not None:
        if slots > fits:
            raise ValueError(f"--mamba-cache-size {slots} needs {slots * per_slot / GiB:.1f} GiB ({slots} x "
                             f"{per_slot / 2**20:.1f} MiB per slot) but the state pool has {how}: at most {fits} "
                             "slots; lower it or raise --mem-fraction-static")
    elif fits < 2:
        raise ValueError(f"the state pool needs {2 * per_slot / GiB:.2f} GiB for 2 slots ({per_slot / 2**20:.1f} MiB "
                         f"each) but has {how}; raise --mem-fraction-static or free memory")
    else:
        slots = min(fits, 4 * (running or default_running))
    if running is None:
        running = max(1, min(default_running, slots * 3 // 4))
    running = min(running, slots)  # each needs a slot: more can never run at once
    return PoolPlan(slots, running, per_slot, budget)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes: the GPU's, or on CPU the machine's physical memory and what is not available;
    in a container with a memory limit (a Kubernetes pod's), that limit and the container's own use."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = cgroup_memory()
    if limited is not None and limited[0] < total:
        return limited
    return total, total - _host_available()


def cgroup_memory(root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, in use) of this process's memory cgroup (v2, else v1), or None without a limit. In use is
    the working set (usage less the inactive page cache the kernel reclaims first), as the kubelet counts it."""
    for limit_file, usage_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            with open(f"{root}/{limit_file}") as f:
                text = f.read().strip()
            if text == "max":
                return None
            with open(f"{root}/{usage_file}") as f:
                usage = int(f.read())
            with open(f"{root}/{stat_file}") as f:
                stats = dict(line.split() for line in f if line.strip())
        except (OSError, ValueError):
            continue
        return int(text), usage - int(stats.get(inactive, 0))
    return None


def _host_available() -> int:
    """Linux's MemAvailable (free memory plus the page cache it can reclaim), else the free pages. Free
    pages alone count the page cache as in use: on a machine that had just built images, 20 of 23.5 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class HybridPlan:
    slots: int
    max_running: int
    pages: int
    bytes_per_slot: int
    bytes_per_page: int
    budget: int


def plan_hybrid(*, total: int, in_use: int, fraction: float, per_slot: int, per_page: int, reserve: int,
                page_size: int, context_length: int, slots: int | None, running: int | None,
                default_running: int, pages: int | None = None, cached: bool = False) -> HybridPlan:
    """State slots, KV pages and the running limit of a hybrid model, from one budget (as ``plan_pool``).

    Without a radix cache or sessions only running requests hold state, so the state pool gets one slot
    per running request; the KV pool gets the rest, at most what every running request could fill (a
    request reserves pages for its whole prompt + max_new_tokens at admission, at most a context), and at
    least one full context. When both do not fit, fewer requests run. Raises ValueError, one line with the
    numbers, when even one request with a full context cannot. ``pages``: an explicit KV pool size
    (``--max-total-tokens``), refused when below one context or beyond the budget. ``cached`` (the radix
    cache is on): the state pool gets up to two slots per running request (the second for snapshots) and
    the KV pool up to twice what the running requests could fill (the rest holds cached prefixes)."""
    budget = int(fraction * total) - in_use - reserve
    context_pages = -(-context_length // page_size)
    how = (f"{fraction:g} x {total / GiB:.1f} GiB (--mem-fraction-static) - {in_use / GiB:.1f} GiB in use "
           f"- {reserve / GiB:.1f} GiB reserved for activations = {max(budget, 0) / GiB:.2f} GiB")
    fit = (budget - context_pages * per_page) // per_slot  # slots beside one context of pages
    if slots is not None and slots > fit:
        raise ValueError(f"--mamba-cache-size {slots} needs {slots * per_slot / GiB:.2f} GiB beside one context of "
                         f"KV pages ({context_pages * per_page / GiB:.2f} GiB) but the pools have {how}: at most "
                         f"{max(fit, 0)} slots")
    if fit < 1:
        raise ValueError(f"a hybrid model needs {(per_slot + context_pages * per_page) / GiB:.2f} GiB for one "
                         f"request of --context-length {context_length} ({per_slot / 2**20:.2f} MiB of state + "
                         f"{context_pages} KV pages of {per_page / 2**20:.3f} MiB) but has {how}; lower "
                         "--context-length or raise --mem-fraction-static")
    if pages is not None and pages < context_pages:
        raise ValueError(f"--max-total-tokens ({pages} pages of {page_size} tokens) holds less than one request of "
                         f"--context-length {context_length}; raise it or lower --context-length")
    if pages is not None and pages * per_page + per_slot > budget:
        raise ValueError(f"--max-total-tokens ({pages} pages of {page_size} tokens) needs {pages * per_page / GiB:.2f} "
                         f"GiB of KV pages but the pools have {how}")
    asked = running
    running = running or default_running
    room = (budget - (pages or context_pages) * per_page) // per_slot if pages else fit
    slots = min(slots or (2 * running if cached else running), room)
    if cached and asked is None:  # as plan_pool: a quarter of a small pool stays for cached snapshots
        running = max(1, min(running, slots * 3 // 4))
    running = min(running, slots)
    if pages is None:
        cap = (2 if cached else 1) * running * context_pages
        pages = max(min((budget - slots * per_slot) // per_page, cap), context_pages)
    return HybridPlan(slots, running, pages, per_slot, per_page, budget)

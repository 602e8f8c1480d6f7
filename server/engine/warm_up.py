"""The start-up kernel warm-up: every Triton specialization a request can reach is compiled before the server
reports ready (``kernels/compiles.py`` counts and logs any that compiles after).

The kernels do not specialise on batch counts (their ``do_not_specialize``), so a launcher's variant depends on a
step only through a few classes, and ``plan`` (pure) lists one forward per class a step can fall in:

- prefill (EXTEND) run eagerly: the number of sequences picks the per-sequence vector width
  (``_dispatch.seq_block``) and the scan's state tile (``ssd_scan.state_tiles``); one token alone takes the fused
  norm + projection paths; from ``ssd_scan.tma_tokens`` tokens (Hopper) the scan reads through TMA; a snapshot
  before the last token (``snap``) and tracked states (``track``) are variants of the scan and conv kernels;
- decode run eagerly (more rows than the largest decode graph, or no graphs): one row (fused paths), the fused
  MoE router's tiles (``topk_softmax.route_tiles``), the state update's tile
  (``selective_state_update.state_update_tiles``), the attention's split count
  (``paged_attention.decode_split_count``, by rows and block-table width);
- MoE experts, by tokens (``moe.launch_variant``): ``warm_up_kernels`` of the model (every MoE layer has the
  same shapes);
- CUDA graphs compile theirs (decode per rows bucket, prefill per (sequences, tokens) bucket) when captured.

``compile_kernels`` runs the plan on borrowed slots and KV pages, padding sequences (slot -1, no pages: they
read and write no state) making up the counts, then captures the graphs. The engine calls it at start;
``tests/server/test_warm_up_coverage.py`` checks on CPU (``kernels.variants.dry_run``, an H100's choices at
real model shapes) that what random request mixes launch is in what it launched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from mambaserve.kernels._dispatch import Target, next_pow2, seq_block, target
from mambaserve.kernels.paged_attention import decode_split_count
from mambaserve.kernels.selective_state_update import state_update_tiles
from mambaserve.kernels.ssd_scan import state_tiles, tma_tokens
from mambaserve.kernels.topk_softmax import route_tiles
from mambaserve.server.cache.pages import pages_for
from mambaserve.server.cache.prefix_cache import StateOps
from mambaserve.server.engine.batch import ForwardBatch
from mambaserve.server.model.inputs import ForwardMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What the served configuration lets a step be."""

    max_running: int  # sequences of a step (--max-running-requests after sizing)
    chunk: int  # tokens of a prefill step (--chunked-prefill-size)
    context_length: int
    track_interval: int = 0  # tracked snapshots every this many prompt tokens (0: none)
    graph_max_bs: int = 0  # decode CUDA graphs up to this many rows (0: no CUDA graphs at all)


@dataclass(frozen=True)
class Shapes:
    """What the launchers' variant choices read of the model: its Mamba layers' dims and kernel config, and
    (hybrids with attention) KV heads and page size."""

    heads: int
    head_dim: int
    state_size: int
    scan_tiles: tuple = ()  # KernelConfig.scan_tiles, as items
    small_tiles: tuple[int, int] = (4, 1)  # KernelConfig.state_update_small_tiles
    kv_heads: int = 0
    page_size: int = 0
    kv_pages: int = 0  # pages a decode row can have at most: the context's, or the pool's if fewer


@dataclass(frozen=True)
class Prefill:
    seqs: int
    tokens: int
    snap: bool = False
    track: bool = False


@dataclass(frozen=True)
class Decode:
    rows: int
    pages: int = 0  # the block table's width (hybrids)


def plan(limits: Limits, m: Shapes, tg: Target, decode_graph_rows: int = 0) -> list[Prefill | Decode]:
    """One step per class of step the served configuration allows (module docstring); decode steps of up to
    ``decode_graph_rows`` rows replay graphs."""
    overrides = dict(m.scan_tiles)
    first: dict[tuple, int] = {}
    for S in range(1, min(limits.max_running, limits.chunk) + 1):
        first.setdefault((seq_block(S), state_tiles(S, m.heads, m.head_dim, m.state_size, tg, overrides)), S)
    tma = tma_tokens(tg, overrides)
    steps: list[Prefill | Decode] = []
    for S in sorted(first.values()):
        tokens = {S} | ({2} if S == 1 and limits.chunk >= 2 else set())  # one token alone runs fused kernels
        if tma is not None and max(S, tma) <= limits.chunk:
            tokens.add(max(S, tma))
        steps += [Prefill(S, T, snap, track) for T in sorted(tokens) for snap in (False, True)
                  for track in ((False, True) if limits.track_interval else (False,))]
    decode: dict[tuple, Decode] = {}
    for B in range(decode_graph_rows + 1, limits.max_running + 1):
        tiles = state_update_tiles(m.head_dim, m.state_size, B * m.heads, m.small_tiles)
        for w in range(1, m.kv_pages + 1) if m.kv_heads else (0,):
            splits = decode_split_count(B, m.kv_heads, w * m.page_size, tg) if m.kv_heads else 1
            key = (B == 1, tuple(route_tiles(B).items()), tiles, splits > 1, next_pow2(splits))
            decode.setdefault(key, Decode(B, w))
    return steps + list(decode.values())


def shapes_of(runner, context_length: int) -> Shapes:
    s, config = runner.model.state_dims, runner.model.kernel_config
    kv = runner.kv_pool
    return Shapes(heads=s.num_heads, head_dim=s.head_dim, state_size=s.state_size,
                  scan_tiles=tuple(sorted(config.scan_tiles.items())), small_tiles=config.state_update_small_tiles,
                  kv_heads=kv.k.shape[3] if kv is not None else 0, page_size=kv.page_size if kv is not None else 0,
                  kv_pages=min(pages_for(context_length, kv.page_size), kv.allocator.capacity) if kv is not None else 0)


def compile_kernels(runner, limits: Limits) -> dict[str, float]:
    """Before the server reports ready: every forward of ``plan`` (results discarded), the MoE layers' variants,
    then the CUDA graphs (``limits.graph_max_bs``: they capture what is compiled by then). Returns the seconds of
    the warm-up (``kernels``) and of the graphs (``graphs``)."""
    t = time.monotonic()
    graphs = limits.graph_max_bs > 0
    decode_rows = limits.graph_max_bs if graphs and runner.model.capture_blocker(ForwardMode.DECODE) is None else 0
    steps = plan(limits, shapes_of(runner, limits.context_length), target(next(runner.model.parameters())), decode_rows)
    _run(runner, steps, limits)
    moe = runner.warm_up_kernels(max(limits.chunk, limits.max_running))
    out = {"kernels": time.monotonic() - t}
    log.info("kernel warm-up: %d forwards and %d MoE runs in %.1f s", len(steps), moe, out["kernels"])
    if graphs:
        t = time.monotonic()
        runner.enable_cuda_graphs(limits.graph_max_bs, limits.chunk, limits.max_running, limits.context_length)
        out["graphs"] = time.monotonic() - t
        if runner.graphs is not None or runner.prefill_graphs is not None:
            log.info("CUDA graphs captured in %.1f s", out["graphs"])
    return out


def _run(runner, steps: list[Prefill | Decode], limits: Limits) -> None:
    """The steps on three borrowed slots (the sequence's, its snapshot's, its tracked state's) and the first one's
    KV pages (hybrids), released afterwards; every other sequence is padding."""
    slots = [runner.pool.allocator.alloc() for _ in range(3)]
    kv = runner.kv_pool.allocator if runner.kv_pool is not None else None
    owner = ("warm-up", slots[0])
    try:
        if None in slots:
            log.warning("kernel warm-up skipped: fewer than 3 free state slots")
            return
        a, c, d = slots
        pages: list[int] = []
        if kv is not None:
            need = max([s.tokens + limits.track_interval for s in steps if isinstance(s, Prefill)]
                       + [s.pages * kv.page_size for s in steps if isinstance(s, Decode)] + [1])
            kv.ensure(owner, min(need, kv.num_free * kv.page_size))
            pages = kv.pages(owner)
        ops = StateOps([("copy", a, c), ("clear", c, c)])  # the state ops' kernels, once
        for step in steps:
            batch = _batch(step, a, c, d, pages, limits.track_interval, kv.page_size if kv is not None else 0)
            if batch is None:
                continue
            batch.state_ops, ops = ops, StateOps()
            runner.forward(batch)
    finally:
        for slot in slots:
            if slot is not None:
                runner.pool.allocator.free(slot)
        if kv is not None:
            kv.release(owner)


def _batch(step: Prefill | Decode, a: int, c: int, d: int, pages: list[int], track_interval: int,
           page_size: int) -> ForwardBatch | None:
    """``step`` as a batch: sequence 0 on slot ``a`` (snapshot to ``c``, tracked state to ``d``), the rest
    padding; None where the borrowed pages are too few for it."""
    pad = step.rows - 1 if isinstance(step, Decode) else step.seqs - 1
    if isinstance(step, Decode):
        start, n, own = max(0, step.pages * page_size - 1), 1, pages[:step.pages]
        mode, snap, track = ForwardMode.DECODE, [], []
    else:
        n = step.tokens - pad
        start = max(0, track_interval - n) if step.track else 0  # the sequence crosses the tracked position
        own = pages[:pages_for(start + n, page_size)] if page_size else []
        mode = ForwardMode.EXTEND
        snap = [(0, c)] if step.snap else []
        track = [(0, track_interval, d)] if step.track else []
    if page_size and len(own) * page_size < start + n:
        return None
    return ForwardBatch(mode, [1] * (n + pad), [n] + [1] * pad, [start] + [0] * pad, [a] + [-1] * pad, track=track,
                        snap=snap, pages=[own] + [[] for _ in range(pad)] if page_size else None)

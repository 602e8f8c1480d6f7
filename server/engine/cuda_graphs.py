"""The forward pass under CUDA graphs: decode per batch-size bucket, short prefills per (sequences, tokens).

Decode is launch-bound at small batch (dozens of kernels per layer, each a few µs of work), so the
whole decode forward is captured once per bucket and replayed. Padded rows carry slot ``-1``: the
state kernels skip them, so no slot is touched. Inputs are copied into static buffers before replay, the
slots only when they changed since the last replay (between most decode steps they do not). Hybrid
models' decode graphs also hold the paged KV view (``decode_buffers``: positions, KV lengths and a block
table as wide as the context); models whose MoE layers run the torch expert loop (no Triton) are not
captured (``capture_blocker``).

Prefill is launch-bound too until thousands of tokens: at mamba2-2.7b shape on an H100 the ~500
launches of an eager prefill cost ~45 ms of host time against 4.7 ms of kernels for 16 tokens
(benchmarks/ttft.py), and a cold request's time to first token was that host time. A prefill graph
is captured per (sequences, tokens) bucket; a batch runs in the smallest bucket with more sequences
and at least as many tokens: its sequences first, then one padding sequence holding the remaining
tokens and empty ones, all padding on slot ``-1`` (the prefill kernels neither read nor write its state).
The kernels take the packed layout (offsets, slots, start positions) from device tensors and size
their grids from the token and sequence counts alone, so one capture serves every layout of a bucket.
Hybrid models' prefill graphs add the paged KV view (positions, cache slots, KV lengths, a block table as wide
as a context): at nemotron-h-8b shape on an H100 an eager 384-token prefill of a cache hit spent 28-42 ms
launching ~1,000 kernels for ~10 ms of device work (benchmarks/hit_profile.py), granite-4.0-h-tiny's 85-100 ms.
"""

from __future__ import annotations

import logging

import torch

from mambaserve.server.cache.pages import pages_for
from mambaserve.server.engine.batch import ForwardBatch
from mambaserve.server.engine.decode_buffers import DecodeBuffers, upload
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model.inputs import BatchTensors, ForwardMode

log = logging.getLogger(__name__)

PREFILL_SEQS = (2, 3, 5, 9, 17, 33)  # sequences per prefill graph: up to one fewer real ones, then the padding
# Tokens per prefill graph, up to the chunked prefill size: in steps of at most 1.33x from 512 to 2,048, where cache
# hits' extend steps fall (padding costs device time: granite-4.0-h-tiny's 8 x 80 new tokens after 1,100 cached took
# 10.8 ms in the 768-token graph on an H200, 8 x 64 9.1 ms in the 512 one), 1.5x elsewhere. Long chunks are graphed
# too: an eager prefill's launches cost tens of ms of host time whatever its length, and at granite-4.0-h-tiny shape
# on an H200 an eager 2,048-token prefill took 53 ms against 17.5 ms replayed.
PREFILL_TOKENS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192)


@torch.inference_mode()
def capture_all(keys, forward, graphs: dict, outputs: dict, warmups: int, prepare=None) -> None:
    """A graph of ``forward(key)`` per key (largest first: the later ones reuse its memory), captured on a
    side stream into one memory pool, after ``warmups`` eager runs of each (cuBLAS handles, Triton compiles),
    and replayed once.
    ``prepare(key)`` runs before them, outside the capture (an upload there would be replayed every time)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for key in keys:
            if prepare is not None:
                prepare(key)
            for _ in range(warmups):
                forward(key)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                outputs[key] = forward(key)
            # The first launch of a graph uploads it to the device, on the critical path of the first request
            # that reaches its bucket: on an H200 a hybrid hit's prefill graph took 5.1 ms of host time on its
            # first launch, 3.1 ms with this replay before it (on the inputs captured: padding only), 1 ms after.
            g.replay()
            graphs[key] = g
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def buckets_up_to(n: int) -> list[int]:
    out = [1, 2, 4, 8, 16, 24, 32]
    while out[-1] < n:
        out.append(out[-1] + (16 if out[-1] < 128 else 32))
    return [b for b in out if b < n] + [n]


class DecodeGraphs:
    """A decode graph per batch-size bucket over one set of static inputs (``DecodeBuffers``: for hybrids,
    the paged KV view with a block table as wide as the context)."""

    def __init__(self, model, pool: MambaStatePool, max_batch: int, device: torch.device,
                 kv_pool: KVPool | None = None, context_length: int = 0):
        self.buckets = buckets_up_to(max_batch)
        self.inputs = DecodeBuffers(model, pool, self.buckets[-1], device, kv_pool, context_length)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        # warm-ups: Triton compiles and autotunes outside the capture; the buffers hold padding rows only
        capture_all(reversed(self.buckets), self.inputs.forward, self.graphs, self.outputs, warmups=2)
        kv = (f", block tables of {self.inputs.max_pages} pages (rows up to {self.inputs.max_kv_tokens} tokens)"
              if self.inputs.kv_pool is not None else "")
        log.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets, kv)

    def fits(self, batch_size: int, start_pos: list[int]) -> bool:
        """A graph can run this step (else it runs eagerly): a bucket holds its rows, the block table its pages."""
        return batch_size <= self.buckets[-1] and self.inputs.fits(start_pos)

    def run(self, token_ids: torch.Tensor, slots: list[int], start_pos: list[int] = (),
            pages: list[list[int]] | None = None) -> torch.Tensor:
        """``token_ids`` on the device (some are the previous step's samples, never seen by the host)."""
        n = len(slots)
        b = next(x for x in self.buckets if x >= n)
        self.inputs.load(b, token_ids, slots, start_pos, pages)
        self.graphs[b].replay()
        return self.outputs[b][:n].clone()  # the static buffer is overwritten by the next replay


def prefill_buckets(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(sequences, tokens) of the prefill graphs, tokens up to ``max_tokens`` (the chunked prefill size:
    no EXTEND step is longer) and real sequences up to ``max_seqs`` (the running limit)."""
    tokens = [t for t in PREFILL_TOKENS if t < max_tokens] + [min(max_tokens, PREFILL_TOKENS[-1])]
    seqs = [s for s in PREFILL_SEQS if s - 1 < max_seqs]
    seqs += [s for s in PREFILL_SEQS if s - 1 >= max_seqs][:1]
    return [(s, t) for s in seqs for t in tokens if s - 1 <= t]


class PrefillGraphs:
    """A prefill graph per (sequences, tokens) bucket over one set of static inputs. Hybrid models' graphs also
    hold the paged KV view: each token's position and cache slot, each sequence's KV length (``ForwardBatch.kv_view``:
    padding writes nothing and attends to nothing) and a block table as wide as a context, so the attention
    kernel's grid depends on the bucket alone; a sequence's row goes up only as wide as the longest of the step."""

    def __init__(self, model, pool: MambaStatePool, max_tokens: int, max_seqs: int, device: torch.device,
                 kv_pool: KVPool | None = None, context_length: int = 0):
        self.model, self.pool, self.kv_pool, self.device = model, pool, kv_pool, device
        self.buckets = prefill_buckets(max_tokens, max_seqs)
        smax, tmax = max(s for s, _ in self.buckets), max(t for _, t in self.buckets)
        self.ids = torch.zeros(tmax, dtype=torch.long, device=device)
        self.cu = torch.zeros(smax + 1, dtype=torch.int32, device=device)
        self.slots = torch.full((smax,), -1, dtype=torch.long, device=device)
        self.has_init = torch.zeros(smax, dtype=torch.bool, device=device)
        self.start = torch.zeros(smax, dtype=torch.long, device=device)
        self.snap = torch.full((smax,), -1, dtype=torch.long, device=device)  # captured with snapshots on
        self.snap_len = torch.zeros(smax, dtype=torch.int32, device=device)
        self.rows = torch.zeros(smax, dtype=torch.long, device=device)
        if kv_pool is not None:
            if context_length < 1:
                raise ValueError("prefill graphs for a KV pool need the context length (the block table's width)")
            self.max_pages = pages_for(context_length, kv_pool.page_size)
            self.positions = torch.zeros(tmax, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((tmax,), -1, dtype=torch.long, device=device)
            self.kv_lens = torch.zeros(smax, dtype=torch.int32, device=device)
            self.block_table = torch.zeros(smax, self.max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def bucket(self, num_seqs: int, num_tokens: int) -> tuple[int, int] | None:
        """The smallest bucket that holds the batch and one padding sequence, or None (run eagerly)."""
        fits = [(t, s) for s, t in self.buckets if s > num_seqs and t >= num_tokens]
        return (min(fits)[1], min(fits)[0]) if fits else None

    def fits(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The bucket this batch runs in, or None: too many sequences or tokens, or (hybrids) a sequence
        longer than the block table."""
        if self.kv_pool is not None and batch.pages and max(map(len, batch.pages)) > self.max_pages:
            return None
        return self.bucket(batch.batch_size, batch.num_tokens)

    def _load(self, s: int, t: int, batch: ForwardBatch | None) -> None:
        """The static inputs of bucket (s, t) for ``batch``'s sequences (the rest is padding; None: all padding)."""
        lens = batch.seq_lens if batch is not None else []
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        pad = s - len(lens)
        slots, start, has_init, snap, snap_len = (
            (batch.slots, batch.start_pos, batch.has_initial_state, batch.snap_slots(), batch.snap_lens())
            if batch is not None else ([], [], [], [], []))
        upload(self.cu[:s + 1], cu + [t] * pad)
        upload(self.slots[:s], list(slots) + [-1] * pad)
        upload(self.has_init[:s], has_init + [False] * pad)
        upload(self.start[:s], list(start) + [0] * pad)
        upload(self.snap[:s], snap + [-1] * pad)
        upload(self.snap_len[:s], snap_len + [0] * pad)
        upload(self.rows[:s], [c - 1 for c in cu[1:]] + [0] * pad)
        if self.kv_pool is None:
            return
        positions, slot_mapping, kv_lens = batch.kv_view(self.kv_pool.page_size) if batch is not None else ([], [], [])
        rest = t - len(positions)
        upload(self.positions[:t], positions + [0] * rest)
        upload(self.slot_mapping[:t], slot_mapping + [-1] * rest)
        upload(self.kv_lens[:s], kv_lens + [0] * pad)
        pages = batch.pages if batch is not None and batch.pages else []
        if pages:  # entries past a sequence's pages are never read: rows go up as wide as the longest only
            w = max(1, max(map(len, pages)))
            upload(self.block_table[:len(pages), :w], [p[:w] + [0] * (w - len(p)) for p in pages])

    def _forward(self, bucket: tuple[int, int]) -> torch.Tensor:
        """The model on bucket (s, t) of the buffers: the logits of each sequence's last token ``[s, V]``. What
        a prefill graph captures: every shape depends on the bucket alone, nothing reads a value to the host."""
        s, t = bucket
        bt = BatchTensors(mode=ForwardMode.EXTEND, cu_seqlens=self.cu[:s + 1], slots=self.slots[:s],
                          has_initial_state=self.has_init[:s], start_pos=self.start[:s], snap_slots=self.snap[:s],
                          snap_len=self.snap_len[:s])
        if self.kv_pool is None:
            return self.model(self.ids[:t], bt, self.pool.conv, self.pool.ssm, self.rows[:s])[0]
        bt.positions, bt.slot_mapping = self.positions[:t], self.slot_mapping[:t]
        bt.kv_lens, bt.block_table = self.kv_lens[:s], self.block_table[:s]
        return self.model(self.ids[:t], bt, self.pool.conv, self.pool.ssm, self.rows[:s],
                          kv=(self.kv_pool.k, self.kv_pool.v))[0]

    def capture(self) -> None:
        def all_padding(bucket: tuple[int, int]) -> None:  # warm-up and capture touch no slot and no page
            self._load(*bucket, None)

        capture_all(sorted(self.buckets, key=lambda b: (-b[1], -b[0])), self._forward, self.graphs, self.outputs,
                    warmups=1, prepare=all_padding)
        log.info("captured %d prefill CUDA graphs, up to %d tokens and %d sequences", len(self.graphs),
                 max(t for _, t in self.buckets), max(s for s, _ in self.buckets) - 1)

    def run(self, bucket: tuple[int, int], token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of each real sequence's last token, ``[batch_size, V]``; the snapshots ``batch.snap`` asks for
        (each sequence's state before its last token) are written."""
        self.ids[:batch.num_tokens].copy_(token_ids)
        self._load(*bucket, batch)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch.batch_size].clone()  # the static buffer is overwritten by the next replay


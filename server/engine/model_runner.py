"""Runs one ForwardBatch: deferred state ops first, then the model.

The only place (with the kernels) that touches the state pool's tensors. Nothing here waits for the
device (host data goes up through pinned memory): the scheduler prepares the next step while this
one runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mambaserve import kernels
from mambaserve.kernels.ssd_scan import snapshot_chunk
from mambaserve.server.cache.prefix_cache import StateOps
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.model.inputs import BatchTensors
from mambaserve.server.model.mamba2 import Mamba2ForCausalLM
from mambaserve.server.engine.sampling import to_device
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.state_pool import HostStatePool, MambaStatePool

log = logging.getLogger(__name__)

KV_BLOCK = 2048  # tokens of K (or V) gathered or scattered at a time: a bounded device buffer (16 MB at 8B's shape)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [S, V] (last token of each sequence) or [T, V] with all_logits; the model's dtype
    # with batch.logprob_at: (logprobs [E] of logprob_next, top (values [E, k], ids [E, k]) or None)
    input_logprobs: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None


class ModelRunner:
    def __init__(self, model: Mamba2ForCausalLM, pool: MambaStatePool, device: torch.device,
                 kv_pool: KVPool | None = None):
        self.model, self.pool, self.device = model, pool, device
        self.kv_pool = kv_pool  # hybrid models with attention layers: their paged KV cache
        self.graphs = None
        self.prefill_graphs = None
        self.host_pool: HostStatePool | None = None  # the host tier's tensors, when it has one
        # Offloads to the host tier run on their own stream, beside the forwards: a write_through copy of a
        # 2.7b snapshot is ~7 ms of PCIe the forward stream no longer waits for. The forward stream waits
        # for them (_join_copies) only before it touches a slot they read, or any host slot.
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies: tuple[torch.cuda.Event, set[int]] | None = None  # (done, source slots) not yet joined

    @property
    def scan_chunk(self) -> int:
        """The chunk scan's chunk for this model: a snapshot a prefill takes at a position (``ForwardBatch.snap``)
        lies in the last of these its sequence crosses (``kernels.ssd_scan.snapshot_chunk``)."""
        return snapshot_chunk(self.model.state_dims.chunk_size, self.model.kernel_config)

    def enable_cuda_graphs(self, max_batch: int, max_prefill_tokens: int = 0, max_prefill_seqs: int = 0,
                           context_length: int = 0) -> None:
        """Capture decode graphs up to ``max_batch`` rows (with a KV pool: rows up to ``context_length``
        tokens) and, with ``max_prefill_tokens``, prefill graphs up to that many tokens and ``max_prefill_seqs``
        sequences, where the model's forward can be captured (else it runs eagerly, as logged)."""
        from mambaserve.server.engine.cuda_graphs import DecodeGraphs, PrefillGraphs

        if blocker := self.model.capture_blocker(ForwardMode.DECODE):
            log.warning("decode CUDA graphs off: %s; decode runs eagerly", blocker)
        else:
            self.graphs = DecodeGraphs(self.model, self.pool, max_batch, self.device, self.kv_pool, context_length)
            self.graphs.capture()
        if max_prefill_tokens and (blocker := self.model.capture_blocker(ForwardMode.EXTEND)):
            log.info("prefill CUDA graphs off: %s", blocker)
        elif max_prefill_tokens:
            self.prefill_graphs = PrefillGraphs(self.model, self.pool, max_prefill_tokens, max_prefill_seqs,
                                                self.device, self.kv_pool, context_length)
            self.prefill_graphs.capture()

    def warm_up_kernels(self, max_tokens: int) -> int:
        """The model's own kernel warm-up (MoE variants), if it has one: the runs it made."""
        return self.model.warm_up_kernels(max_tokens) if hasattr(self.model, "warm_up_kernels") else 0

    @property
    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """One slot's state, every layer, as ``read_slot`` returns it and ``write_slot`` takes it."""
        return self.pool.slot_shapes

    @property
    def slot_bytes(self) -> int:
        """One slot's state, every layer, as files and the host and storage tiers hold it."""
        return self.pool.bytes_per_slot

    def apply_state_ops(self, ops: StateOps) -> None:
        """In the order recorded, before the forward and in order with the steps before it: copies and
        clears batched per run and loads from the host on the forward's stream, offloads to the host on the
        copy stream (after everything launched so far; anything recorded after one waits for it)."""
        self._run_ops(ops)

    def _run_ops(self, ops: StateOps) -> None:
        for kind, pairs in ops.runs():
            if kind not in ("offload", "kv_out", "kv_in"):  # (those read and write pages, never a slot)
                self._join_copies()
            if kind == "kv_out":
                for copy, _ in pairs:
                    copy.k, copy.v = self._kv_to_host(copy.table, copy.a, copy.b)
            elif kind == "kv_in":
                for copy, _ in pairs:
                    self._kv_from_host(copy.table, copy.a, copy.k, copy.v)
            elif kind == "copy":
                src = to_device([s for s, _ in pairs], torch.long, self.device)
                dst = to_device([d for _, d in pairs], torch.long, self.device)
                kernels.copy_slots(self.pool.conv, src, dst)
                kernels.copy_slots(self.pool.ssm, src, dst)
            elif kind == "clear":
                idx = to_device([s for s, _ in pairs], torch.long, self.device)
                kernels.clear_slots(self.pool.conv, idx)
                kernels.clear_slots(self.pool.ssm, idx)
            elif kind == "offload":
                self._offload(pairs)
            else:
                self._load(pairs)
        if ops.on_done:  # storage writes of host slots filled above: they wait for this event, not the host
            event = self.fence()
            for done in ops.on_done:
                done(event)

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        for h, slot in pairs:
            self.pool.conv[:, slot].copy_(self.host_pool.conv[h], non_blocking=True)
            self.pool.ssm[:, slot].copy_(self.host_pool.ssm[h], non_blocking=True)

    def _offload(self, pairs: list[tuple[int, int]]) -> None:
        if self.copy_stream is None:  # CPU: synchronous copies
            for slot, h in pairs:
                self.host_pool.conv[h].copy_(self.pool.conv[:, slot])
                self.host_pool.ssm[h].copy_(self.pool.ssm[:, slot])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the states are computed
        with torch.cuda.stream(self.copy_stream):
            for slot, h in pairs:
                self.host_pool.conv[h].copy_(self.pool.conv[:, slot], non_blocking=True)
                self.host_pool.ssm[h].copy_(self.pool.ssm[:, slot], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        sources = self._copies[1] if self._copies else set()
        self._copies = (done, sources | {slot for slot, _ in pairs})

    def _join_copies(self, slots=None) -> None:
        """The forward stream waits for the offloads not yet joined (all, or those reading ``slots``); ones
        already done are forgotten without a wait."""
        if self._copies is None:
            return
        done, sources = self._copies
        if done.query():
            self._copies = None
        elif slots is None or not sources.isdisjoint(slots):
            torch.cuda.current_stream(self.device).wait_event(done)
            self._copies = None

    def fence(self):
        """A CUDA event after everything launched so far on both streams (None on the CPU, where copies are
        synchronous): the storage thread waits on it before it reads a host slot an offload fills, or
        overwrites one a launched load may still read."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        event.record(self.copy_stream)
        return event

    def copy_out(self, slot: int, kv: tuple[list[int], int, int] | None = None) -> tuple[dict, object]:
        """A host copy of ``slot``'s state (``conv``, ``ssm``) and, with ``kv = (block table, a, b)``, of the K/V
        of tokens [a, b) (``k``, ``v``: ``[b - a, La, Hkv, D]``), made after everything launched so far; nothing
        waits for it. On CUDA the state goes straight from its slot on the copy stream (the forward stream joins
        it before writing that slot). Returns (tensors, a CUDA event after which they are complete, None on the
        CPU)."""
        pin = self.copy_stream is not None
        out = {"conv": torch.empty(self.pool.conv[:, slot].shape, dtype=self.pool.conv.dtype, pin_memory=pin),
               "ssm": torch.empty(self.pool.ssm[:, slot].shape, dtype=self.pool.ssm.dtype, pin_memory=pin)}
        if kv is not None:
            out["k"], out["v"] = self._kv_to_host(*kv)
        if self.copy_stream is None:
            out["conv"].copy_(self.pool.conv[:, slot])
            out["ssm"].copy_(self.pool.ssm[:, slot])
            return out, None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            out["conv"].copy_(self.pool.conv[:, slot], non_blocking=True)
            out["ssm"].copy_(self.pool.ssm[:, slot], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        sources = self._copies[1] if self._copies else set()
        self._copies = (done, sources | {slot})
        return out, done

    def _kv_to_host(self, table: list[int], a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [a, b) of the sequence whose pages are ``table``, in new host tensors ``[b - a, La, Hkv,
        D]``: gathered on the forward stream a block of tokens at a time (in order with the forwards: what one
        launched later writes is not read; a bounded device buffer) and copied to the host on the copy stream
        (complete once ``fence()``, or the copy stream's next event, has passed)."""
        pool, pin, out = self.kv_pool, self.copy_stream is not None, []
        for cache in (pool.k, pool.v):
            rows = pool.tokens_major(cache)
            host = torch.empty(b - a, *rows.shape[1:], dtype=cache.dtype, pin_memory=pin)
            for i in range(a, b, KV_BLOCK):
                j = min(b, i + KV_BLOCK)
                block = rows.index_select(0, pool.token_index(table, i, j, self.device))
                if self.copy_stream is None:
                    host[i - a:j - a].copy_(block)
                    continue
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.copy_stream):
                    host[i - a:j - a].copy_(block, non_blocking=True)
                block.record_stream(self.copy_stream)  # (its memory is not reused before that copy ran)
            out.append(host)
        return out[0], out[1]

    def _kv_from_host(self, table: list[int], a: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host tensors ``[n, La, Hkv, D]`` into tokens [a, a + n) of the pages of ``table``, on the forward
        stream (pinned host tensors: nothing waits)."""
        pool = self.kv_pool
        for cache, src in ((pool.k, k), (pool.v, v)):
            rows = pool.tokens_major(cache)
            for i in range(0, len(src), KV_BLOCK):
                j = min(len(src), i + KV_BLOCK)
                rows.index_copy_(0, pool.token_index(table, a + i, a + j, self.device),
                                 src[i:j].to(self.device, non_blocking=True))

    def load_in(self, slot: int, state: dict, table: list[int] | None = None) -> None:
        """Write host tensors as ``copy_out`` makes them (a KV of tokens [0, n)) into ``slot`` and the pages of
        ``table``, on the forward stream: after everything launched so far, before anything launched later
        (pinned host tensors: nothing waits)."""
        self._join_copies([slot])
        self.pool.conv[:, slot].copy_(state["conv"], non_blocking=True)
        self.pool.ssm[:, slot].copy_(state["ssm"], non_blocking=True)
        if table is not None and "k" in state:
            self._kv_from_host(table, 0, state["k"], state["v"])

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's state, every layer: ``{"conv": [L, conv_dim, K-1], "ssm": [L, H, P, N]}``."""
        return {"conv": self.pool.conv[:, slot].clone(), "ssm": self.pool.ssm[:, slot].clone()}

    def write_slot(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        self._join_copies([slot])
        self.pool.conv[:, slot] = state["conv"].to(self.pool.conv.device, self.pool.conv.dtype)
        self.pool.ssm[:, slot] = state["ssm"].to(self.pool.ssm.device, self.pool.ssm.dtype)

    def _token_ids(self, batch: ForwardBatch) -> torch.Tensor:
        n = len(batch.token_ids)
        if n and batch.from_prev == [(i, i) for i in range(n)]:
            # every row continues the same row of the step before (steady decode): no uploads, no index kernels
            return batch.prev_tokens[:n]
        ids = to_device(batch.token_ids, torch.long, self.device)
        if batch.from_prev:
            pos, rows = zip(*batch.from_prev)
            ids[to_device(pos, torch.long, self.device)] = batch.prev_tokens[to_device(rows, torch.long, self.device)]
        return ids

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self._run_ops(batch.state_ops)
        # a slot an offload still reads is not written before the copy is done
        self._join_copies([*batch.slots, *batch.snap_slots(), *(slot for _, _, slot in batch.track)])
        ids = self._token_ids(batch)
        if (self.graphs is not None and batch.mode is ForwardMode.DECODE
                and self.graphs.fits(batch.batch_size, batch.start_pos)):
            return ForwardOutput(logits=self.graphs.run(ids, batch.slots, batch.start_pos, batch.pages))
        if (self.prefill_graphs is not None and batch.mode is ForwardMode.EXTEND and not batch.track
                and not batch.all_logits and not batch.logprob_at):
            bucket = self.prefill_graphs.fits(batch)
            if bucket is not None:
                return ForwardOutput(logits=self.prefill_graphs.run(bucket, ids, batch))
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
            snap_slots=to_device(batch.snap_slots(), torch.long, dev) if batch.snap else None,
            snap_len=to_device(batch.snap_lens(), torch.int32, dev) if batch.snap else None,
            host_cu=cu,
            host_start=list(batch.start_pos),
        )
        rows = None
        if batch.mode is ForwardMode.EXTEND and not batch.all_logits:
            rows = to_device([c - 1 for c in cu[1:]] + batch.logprob_at, torch.long, dev)
        if self.kv_pool is None:
            logits, tracked = self.model(ids, bt, self.pool.conv, self.pool.ssm, rows)
        else:
            self._attention_inputs(batch, bt)
            logits, tracked = self.model(ids, bt, self.pool.conv, self.pool.ssm, rows,
                                         kv=(self.kv_pool.k, self.kv_pool.v))
        input_logprobs = None
        if batch.logprob_at and not batch.all_logits:
            logits, input_logprobs = logits[:batch.batch_size], _prompt_logprobs(logits[batch.batch_size:], batch)
        if batch.track:  # tracked states into their snapshot slots, all layers at once
            dst = to_device([slot for _, _, slot in batch.track], torch.long, dev)
            self.pool.conv[:, dst] = torch.stack([c for c, _ in tracked]).to(self.pool.conv.dtype)
            self.pool.ssm[:, dst] = torch.stack([s for _, s in tracked]).to(self.pool.ssm.dtype)
        return ForwardOutput(logits=logits, input_logprobs=input_logprobs)

    def _attention_inputs(self, batch: ForwardBatch, bt: BatchTensors) -> None:
        """The paged KV cache's view of the batch (``BatchTensors.positions`` .. ``kv_lens``,
        ``ForwardBatch.kv_view``) and its block table, built on the host from each sequence's pages."""
        positions, slots, kv_lens = batch.kv_view(self.kv_pool.page_size)
        pages = batch.pages or [[] for _ in batch.seq_lens]
        width = max(1, max(len(p) for p in pages))
        table = [p + [0] * (width - len(p)) for p in pages]
        dev = self.device
        bt.positions = to_device(positions, torch.long, dev)
        bt.slot_mapping = to_device(slots, torch.long, dev)
        bt.kv_lens = to_device(kv_lens, torch.int32, dev)
        bt.block_table = to_device(table, torch.int32, dev).view(len(table), width)


def _prompt_logprobs(logits: torch.Tensor, batch: ForwardBatch):
    """Log-softmax of the prompt positions' logits: each one's logprob of the prompt token after it, and
    the top ``batch.logprob_top``."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    nxt = to_device(batch.logprob_next, torch.long, logits.device)
    chosen = logp.gather(-1, nxt[:, None])[:, 0]
    top = None
    if batch.logprob_top:
        t = logp.topk(min(batch.logprob_top, logp.shape[-1]), dim=-1)
        top = (t.values, t.indices)
    return chosen, top

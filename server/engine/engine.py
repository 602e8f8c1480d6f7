"""The engine: a loaded model, its tokenizer and a running scheduler, behind an asyncio API.

The HTTP layer calls only this class: ``generate`` (an async iterator of StepOutput increments),
``abort``, the session verbs, ``flush_cache`` and the info methods. Everything heavy happens on the
scheduler thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from mambaserve.kernels import compiles
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine import timeline, warm_up
from mambaserve.server.engine.constraints import Constraint
from mambaserve.server.engine.detokenizer import IncrementalDetokenizer
from mambaserve.server.engine.grammar import Compiled, Grammars
from mambaserve.server.engine.metrics import ServerMetrics
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.pools import build_pools
from mambaserve.server.engine.ranks import Ranks, rank_device
from mambaserve.server.engine.request import BadRequest, Overloaded, Req, SamplingParams, StepOutput, fit_to_context
from mambaserve.server.engine.scheduler import Scheduler
from mambaserve.server.engine.tp_runner import LeaderRunner
from mambaserve.server.model.config import read_config
from mambaserve.server.model.hub import hub_id
from mambaserve.server.model.hub import resolve as resolve_checkpoint
from mambaserve.server.model.loader import DTYPES, load_model, resolve_device, resolve_dtype
from mambaserve.server.model.parallel import SINGLE, TP
from mambaserve.server.model.registry import resolve
from mambaserve.server.model.tokenizer import encode, load_tokenizer, render_chat
from mambaserve.server.sessions import snapshot as session_snapshot
from mambaserve.server.sessions.snapshot_store import SnapshotStore
from mambaserve.server.sessions.table import Caller, SessionError, TurnParams

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 8192
HYBRID_PAGE_SIZE = 16  # KV tokens per page for hybrids unless --page-size says (not yet measured against others)


def tp_refusals(cfg: ServerConfig, hybrid: bool) -> list[str]:
    """The features a tensor-parallel server cannot run with yet, as the flags that ask for them."""
    out = []
    if cfg.storage_dir and hybrid:
        out.append("--storage-dir with a hybrid model (its entries hold the attention layers' KV, which the ranks hold "
                   "by heads: not gathered yet; --host-cache-size works)")
    return out


class Engine:
    def __init__(self, cfg: ServerConfig, arrivals: timeline.Arrivals | None = None):
        """``arrivals``: the HTTP edge's count of generation requests received and not yet submitted (its
        connections' ``ConnectionGuard.arrivals``), which the scheduler holds an idle step for."""
        ref = hub_id(cfg.model)
        if ref is not None:  # --model org/name[@revision]: its snapshot in the hub's cache, named by the repository
            cfg = dataclasses.replace(cfg, model=str(resolve_checkpoint(cfg.model)),
                                      served_model_name=cfg.served_model_name or ref[0])
        self.cfg = cfg
        self._begun = begun = time.monotonic()
        if cfg.kernel_cache_dir:  # before anything compiles
            compiles.set_cache_dir(cfg.kernel_cache_dir)
        self.device = resolve_device(cfg.device)
        self.ranks: Ranks | None = None  # --tensor-parallel-size > 1: the follower processes
        tp_size = cfg.tensor_parallel_size
        if tp_size > 1 and self.device.type == "cuda":
            if torch.cuda.device_count() < tp_size:
                raise ValueError(f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs; this process sees "
                                 f"{torch.cuda.device_count()}")
            self.device = rank_device(self.device, 0)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        # what the flags ask of the architecture is judged from config.json, before the weights load
        hf_config = read_config(Path(cfg.model))
        self.architecture = resolve(hf_config)
        self.hybrid = self.architecture.hybrid
        if not self.hybrid and cfg.max_total_tokens:
            raise ValueError(f"--max-total-tokens sizes a hybrid model's KV pool; {self.architecture.name} has no "
                             "attention layers")
        if tp_size > 1 and (refused := tp_refusals(cfg, self.hybrid)):
            raise ValueError("not built for --tensor-parallel-size > 1 yet: " + "; ".join(refused))
        self.dims = self.architecture.read_dims(hf_config)
        if self.hybrid and self.dims.mamba is None:
            raise ValueError(f"{self.architecture.name} without Mamba layers: this server runs hybrids with at least "
                             "one Mamba2 layer")
        if tp_size > 1:  # a model that cannot be split so is refused before any process starts
            with torch.device("meta"):
                self.architecture.model_class(self.dims, None, TP(0, tp_size))
        # the tokenizer first: a checkpoint without one (mamba_ssm's) is refused before minutes of weights load
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        # --page-size: KV page size for hybrids (default 16), radix-key alignment for pure Mamba2 (default 1)
        self.cfg = cfg = dataclasses.replace(cfg, page_size=cfg.page_size or (HYBRID_PAGE_SIZE if self.hybrid else 1))
        if len(self.tokenizer) > self.dims.vocab_size:  # (a padded vocabulary is larger, never smaller)
            log.warning("the tokenizer has %d tokens but the model's vocabulary %d: text whose ids reach past it is "
                        "refused; is --tokenizer the model's?", len(self.tokenizer), self.dims.vocab_size)
        self.model_name = cfg.served_model_name or Path(cfg.model).resolve().name
        self.context_length = cfg.context_length or self._default_context_length()
        trained = self.dims.max_position_embeddings
        if trained and self.context_length > trained:
            log.warning("--context-length %d is longer than the checkpoint's max_position_embeddings %d: positions "
                        "past it are beyond what the model was built for (RoPE models extrapolate)",
                        self.context_length, trained)
        self.track_interval = self._track_interval()
        is_cuda = self.device.type == "cuda"
        tp = SINGLE
        if tp_size > 1:  # the followers load their shards while this process loads its own
            self.ranks = Ranks.start(cfg, self.context_length, tp_size, self.device)
            tp = self.ranks.tp
        try:
            self.model, self.hf_config = load_model(cfg.model, self.dtype, self.device, tp=tp)
            pools = build_pools(cfg, self.model, self.device, self.dtype, self.context_length, self.hybrid, tp)
        except BaseException:
            self._stop_ranks()
            raise
        plan, self.pool, self.kv_pool = pools.plan, pools.pool, pools.kv_pool
        self.max_running = plan.max_running
        if cfg.max_running_requests and plan.max_running < cfg.max_running_requests:
            log.warning("--max-running-requests %d lowered to %d: each running request needs one of the %d state slots",
                        cfg.max_running_requests, plan.max_running, plan.slots)
        self.metrics = ServerMetrics()
        self.ready_at: float | None = None  # when the server reported ready (mark_ready): compiles after it are logged
        self.compiles = {"warmup": 0, "serving": 0}  # Triton compiles in this process while this engine ran
        self._stop_watching = compiles.watch(self._compiled)
        self.startup = {"load": time.monotonic() - begun}  # seconds per phase of the start, logged when ready
        runner = (LeaderRunner(self.model, self.pool, self.device, self.kv_pool, self.ranks) if self.ranks
                  else ModelRunner(self.model, self.pool, self.device, self.kv_pool))
        runner.host_pool = pools.host_pool
        self.runner = runner
        if is_cuda:  # every kernel variant a request can reach, then the CUDA graphs (engine/warm_up.py)
            self.startup |= warm_up.compile_kernels(runner, warm_up.Limits(
                max_running=self.max_running, chunk=cfg.chunked_prefill_size, context_length=self.context_length,
                track_interval=self.track_interval,
                graph_max_bs=0 if cfg.disable_cuda_graph else min(self.max_running, cfg.cuda_graph_max_bs)))
        self.scheduler = Scheduler(
            cfg, runner, self.metrics, max_running=self.max_running, context_length=self.context_length,
            track_interval=self.track_interval, storage_compat=self._storage_compat() if cfg.storage_dir else None,
            arrivals=arrivals)
        self.snapshots = SnapshotStore(Path(cfg.session_snapshot_dir),
                                       session_snapshot.compat_key(self.hf_config, self.dtype, DTYPES[cfg.state_dtype]),
                                       cfg.session_snapshot_max_bytes, cfg.session_snapshot_max_per_session)
        eos = set(self.dims.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(self.tokenizer, self.dims.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self._active = 0  # requests between submit and their last output (touched on the event loop only)
        log.info("state pool: %d slots x %.2f MiB = %.2f GiB (room for %d: %.2f GiB); context length %d; max running %d",
                 self.pool.allocator.capacity, self.pool.bytes_per_slot / 2**20,
                 self.pool.allocator.capacity * self.pool.bytes_per_slot / 2**30, plan.budget // plan.bytes_per_slot,
                 plan.budget / 2**30, self.context_length, self.max_running)
        self._built = time.monotonic()

    def _storage_compat(self) -> dict:
        """The storage tier's compatibility key: what a stored state depends on (cache.storage_entry)."""
        from mambaserve.server.cache import storage_entry

        t = time.monotonic()
        cache_file = Path(self.cfg.storage_dir) / ".weights-fingerprints.json"
        try:
            weights = storage_entry.weights_fingerprint(self.cfg.model, cache_file)
        except OSError as e:  # hub ids resolve elsewhere; the directory name and config then stand for it
            log.warning("weights not fingerprinted (%s): storage entries are keyed by the model's name", e)
            weights = f"name:{self.model_name}"
        shapes, kv = self.runner.slot_shapes, self.kv_pool  # (one device's layout, whatever the TP size)
        key = storage_entry.compat_key(self.hf_config, weights, self.dtype, DTYPES[self.cfg.state_dtype],
                                       self.dims.num_layers, shapes["conv"], shapes["ssm"], self.dims.chunk_size,
                                       kv=(kv.k.shape[0], *kv.k.shape[3:], str(kv.k.dtype)) if kv else None)
        log.info("storage compatibility key in %.1f s: weights %s", time.monotonic() - t, weights)
        return key

    def _track_interval(self) -> int:
        """Tracked-snapshot interval: states come from the chunked scan's chunk boundaries, so it must be
        a multiple of the model's chunk size; default for extra_buffer: the multiple nearest 256."""
        cfg, q = self.cfg, self.dims.chunk_size
        if cfg.mamba_cache_strategy not in ("no_buffer", "extra_buffer"):
            raise ValueError(f"--mamba-cache-strategy must be no_buffer or extra_buffer, got {cfg.mamba_cache_strategy!r}")
        if cfg.mamba_cache_strategy == "no_buffer":
            if cfg.mamba_track_interval:
                raise ValueError("--mamba-track-interval needs --mamba-cache-strategy extra_buffer")
            return 0
        n = cfg.mamba_track_interval or max(q, round(256 / q) * q)
        if n <= 0 or n % q:
            raise ValueError(f"--mamba-track-interval {n} must be a positive multiple of the model's chunk size {q}")
        if self.hybrid and n % cfg.page_size:  # a tracked state is kept with the KV pages of its tokens
            which = "" if cfg.mamba_track_interval else " (the default)"
            raise ValueError(f"--mamba-track-interval {n}{which} must be a multiple of --page-size {cfg.page_size} for "
                             f"{self.architecture.name}: the radix cache keeps states on page boundaries only")
        return n

    def _default_context_length(self) -> int:
        n = self.dims.max_position_embeddings or getattr(self.tokenizer, "model_max_length", None)
        return int(n) if n and n < 10**7 else DEFAULT_CONTEXT_LENGTH

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        """Stop the scheduler (and the followers of a tensor-parallel server); the storage tier's queued writes are
        on disk when this returns."""
        self._stop_watching()
        self.scheduler.stop()
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    def mark_ready(self) -> None:
        """The server reports ready from now on: a kernel that compiles after this made requests wait (a
        WARNING each, and ``mambaserve_kernel_compiles_total{phase="serving"}``). Logs where the start went."""
        self.ready_at = time.monotonic()
        s, cache = self.startup, os.environ.get("TRITON_CACHE_DIR")
        log.info("ready in %.1f s: model and pools %.1f s, kernel warm-up %.1f s, CUDA graphs %.1f s, then %.1f s "
                 "(server warm-up requests); %d kernel compiles before ready (%s)", self.ready_at - self._begun,
                 s["load"], s.get("kernels", 0.0), s.get("graphs", 0.0), self.ready_at - self._built,
                 self.compiles["warmup"], f"compile cache {cache}" if cache else "Triton's default compile cache")

    def _compiled(self, event: compiles.Compile) -> None:
        """From the compiling thread (``kernels.compiles``)."""
        phase = "warmup" if self.ready_at is None else "serving"
        self.compiles[phase] += 1
        self.metrics.kernel_compiles.labels(phase).inc()
        if phase == "warmup":
            return
        took = f" in {event.seconds:.2f} s" if event.seconds is not None else ""
        log.warning("kernel %s compiled%s after the server was ready: requests waited for it (the warm-up missed "
                    "this specialization: %s)", event.kernel, took, event.key)

    # ---- requests -----------------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    async def tokenize(self, text: str) -> list[int]:
        """``encode`` on a worker thread: a long prompt must not stall the event loop (health checks, streams)."""
        return await asyncio.to_thread(self.encode, text)

    async def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_args) -> list[int]:
        """The chat template applied (``model.tokenizer.render_chat``) and the result tokenized, off the event
        loop (ValueError: no template, or one that refuses the messages)."""
        return await asyncio.to_thread(lambda: self.encode(render_chat(self.tokenizer, messages, tools,
                                                                       **template_args)))

    def check_load(self, prompts: int = 1) -> None:
        """Refuse more work than the queue bound allows: 400 for too many prompts in one request, 503
        (Overloaded) while running + queued requests would exceed ``--max-queued-requests`` beyond the running."""
        if prompts > self.cfg.max_prompts_per_request:
            raise BadRequest(f"{prompts} answers asked for in one request (prompts x n); at most "
                             f"{self.cfg.max_prompts_per_request} (--max-prompts-per-request)")
        if self._active + prompts > self.scheduler.max_running + self.cfg.max_queued_requests:
            raise Overloaded(f"the server has {self._active} requests in progress (at most "
                             f"{self.scheduler.max_running} running and {self.cfg.max_queued_requests} queued); "
                             "retry later")

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams, max_tokens_explicit: bool) -> SamplingParams:
        """Validate a prompt against the model; returns params with max_new_tokens fitted to the context."""
        params.validate()
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        self.check_token_ids(prompt_ids)
        self.check_token_ids(params.token_ids(), "token ids of the sampling parameters")
        return fit_to_context(len(prompt_ids), params, self.context_length, max_tokens_explicit)

    def check_token_ids(self, ids: Iterable[int], what: str = "token ids") -> None:
        """BadRequest naming the first few of ``ids`` outside the model's vocabulary."""
        vocab, ids = self.dims.vocab_size, list(ids)
        if not ids or 0 <= min(ids) and max(ids) < vocab:  # (a prompt's thousands of ids: at C speed)
            return
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{what} out of range [0, {vocab}): {bad[:5]}")

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, rid: str | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1,
                 session_id: str | None = None, turn_params: TurnParams | None = None, stream: bool = True,
                 follows=None, grammar: Compiled | None = None, group: str | None = None) -> Generation:
        """Submit a request now; its increments come from the returned async iterator until it finishes,
        and closing the iterator early aborts the request (call from the event loop). ``prompt_ids`` and
        ``params`` are taken as ``validate`` passed them (the HTTP edge calls it first): an id outside the
        vocabulary here fails the whole step it lands in, not this request alone.

        With ``session_id``, ``prompt_ids`` are the turn's new tokens only; the session adds its history.
        A refused request yields one output with ``error_status`` set. With ``stream=False`` only the
        final output comes (all tokens and text at once): less work per token for the scheduler.
        ``logprob_start_len`` >= 0 (with ``return_logprob``): the first output also carries the logprobs
        of the prompt's tokens from that position on (the first token's is None); the positions they
        need are computed even where a cached state covers them."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        rid = rid or self.new_rid()
        tl = timeline.current.get()
        if tl is not None:
            tl.mark("validated")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = Req(rid=rid, prompt_ids=list(prompt_ids), params=params,
                  detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                                     prompt_tail=list(prompt_ids[-4:]), incremental=stream,
                                                     keep_stop=params.include_stop_str_in_output),
                  constraint=self._constraint(params, grammar),
                  stream=stream,
                  emit=functools.partial(self.scheduler.outbox.post, loop, q.put_nowait),
                  return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                  logprob_start_len=logprob_start_len if return_logprob else -1,
                  stop_token_ids=frozenset(stop_ids), session_id=session_id,
                  turn_params=turn_params or TurnParams(), timeline=tl, follows=follows, group=group or rid)
        if req.logprob_start_len == 0:  # nothing predicts the first token
            req.input_logprobs, req.input_top_logprobs = [None], [None]
        self.scheduler.submit(req)
        self._active += 1
        return Generation(self, req, q)

    async def before_submit(self, prompts: int) -> None:
        """Right before submitting ``prompts`` requests: one pass of the event loop, then ``check_load`` again,
        with nothing between it and the submission. In that pass, requests whose bytes came in meanwhile get
        their headers parsed and are counted as arriving (``timeline.Arrivals``), so that an idle scheduler holds
        its step for them instead of launching it for this request alone: a burst's requests reach the server a
        few tenths of a millisecond apart, and the loop takes longer than that over each."""
        await asyncio.sleep(0)
        self.check_load(prompts)

    async def compile_grammar(self, params: SamplingParams) -> Compiled | None:
        """``params.constraint`` compiled (or from the cache) on a worker thread; BadRequest if it is not a
        grammar. Pass the result to ``generate`` (which otherwise compiles it on the event loop)."""
        if params.constraint is None:
            return None
        return await asyncio.to_thread(self.grammars.compile, *params.constraint)

    def _constraint(self, params: SamplingParams, grammar: Compiled | None) -> Constraint | None:
        if not params.constrained:
            return None
        if params.constraint is not None and grammar is None:
            grammar = self.grammars.compile(*params.constraint)
        return Constraint(params, self.dims.vocab_size, self.tokenizer, grammar.matcher() if grammar else None)

    def generate_n(self, prompt_ids: list[int], params: SamplingParams, n: int, **kw) -> list[Generation]:
        """``n`` answers to one prompt: the first prefills it; the others wait for that prefill and start
        from its state (a snapshot copy through the radix cache) instead of prefilling it again. They are one
        admission group: they take turns for slots with newer requests (``policy.admission_order``). A
        request seed gives copy i the seed + i (distinct answers, reproducible). Prompt logprobs
        (``logprob_start_len``) are computed by the first alone: the others' prompt is the same."""
        gens = [self.generate(prompt_ids, params, **kw)]
        kw["logprob_start_len"] = -1
        for i in range(1, n):
            p = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**63)
            gens.append(self.generate(prompt_ids, p, follows=gens[0].req, group=gens[0].rid, **kw))
        return gens

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    async def run_in_scheduler(self, fn):
        """Run ``fn()`` on the scheduler thread between two steps; its result or exception comes back."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    @property
    def healthy(self) -> bool:
        return self.scheduler.alive

    @property
    def capacity_lost(self) -> str | None:
        """Why the pools' accounting no longer adds up after a failed step (None: it does)."""
        return self.scheduler.lost

    @property
    def storage_status(self) -> str:
        """The storage tier's trouble in a line ("" when it reads and writes, or there is none)."""
        storage = self.scheduler.storage
        return storage.status if storage is not None else ""

    def liveness(self, timeout: float) -> tuple[bool, dict]:
        """(live, progress): not live when the scheduler thread is gone, or when its step has run longer than
        ``timeout`` seconds with requests pending (a wedged GPU, a hung kernel). An idle server stays live."""
        info = {"alive": self.scheduler.alive, "timeout_seconds": timeout, **self.scheduler.progress()}
        running = info["step_running_seconds"]
        stuck = running is not None and running > timeout and info["pending_requests"] > 0
        return info["alive"] and not stuck, info

    async def flush_cache(self) -> int:
        """Empty the radix cache (CacheBusyError while requests run); returns the snapshots freed."""
        return await self.run_in_scheduler(self.scheduler.flush_cache)

    async def accounting(self) -> dict:
        return await self.run_in_scheduler(self.scheduler.accounting)

    async def load(self) -> dict:
        return await self.run_in_scheduler(self.scheduler.load)

    # ---- sessions -----------------------------------------------------------------------------------
    async def open_session(self, session_id: str | None, streaming: bool, timeout: float | None,
                           capacity: int | None, caller: Caller = Caller()) -> str:
        return await self.run_in_scheduler(lambda: self.scheduler.sessions.open(session_id, streaming, timeout,
                                                                                capacity, caller))

    async def close_session(self, session_id: str, caller: Caller = Caller()) -> None:
        await self.run_in_scheduler(lambda: self.scheduler.sessions.close(session_id, caller=caller))

    async def session_count(self) -> int:
        return await self.run_in_scheduler(lambda: len(self.scheduler.sessions.table.sessions))

    async def persist_sessions(self) -> tuple[int, list[str]]:
        """A draining server's open sessions on storage (``--session-persist``): those whose record is behind
        (a write that failed, a session restored from a snapshot file and not used since) written now. Returns
        (sessions written, ids of those not on storage: nothing persists without the flag)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        await self.run_in_scheduler(lambda: self.scheduler.persist_sessions(
            lambda *result: loop.call_soon_threadsafe(done.set_result, result)))
        return await done

    async def snapshot_session(self, session_id: str, name: str | None, caller: Caller = Caller()) -> dict:
        """The session's tokens and state copied out between two steps, then written by the snapshot store's
        thread: no file is touched on the scheduler thread."""
        name = name or f"{session_id}.safetensors"
        session_snapshot.snapshot_path(self.snapshots.directory, name)  # a bad name: 400 before any work
        for _ in range(500):  # a turn that just answered folds its last token within a step
            try:
                out = await self.run_in_scheduler(lambda: self.scheduler.session_files.export(session_id, caller))
                break
            except SessionError as e:
                if e.code != "session_folding":
                    raise
            await asyncio.sleep(0.01)
        else:
            raise SessionError(503, f"session {session_id!r} did not become idle", "session_busy")
        return await asyncio.wrap_future(self.snapshots.save(session_id, name, out.tokens, out.meta, out.state,
                                                             out.ready))

    async def restore_session(self, name: str, session_id: str | None, caller: Caller = Caller()) -> dict:
        """The file read and verified (checksum, then contents) on the snapshot store's thread; the session
        recreated between two steps. A refused file is logged and counted by reason."""
        try:
            meta, tokens, state = await asyncio.wrap_future(self.snapshots.load(name, self._check_snapshot))
        except session_snapshot.SnapshotError as e:
            if e.reason:
                self.metrics.files_rejected.labels("snapshot", e.reason).inc()
                log.warning("snapshot %r refused (%s): %s", name, e.reason, e)
            raise
        return await self.run_in_scheduler(
            lambda: self.scheduler.session_files.restore(meta, tokens, state, session_id, caller))

    def _check_snapshot(self, meta: dict, tokens: list[int], state: dict | None) -> None:
        session_snapshot.check_snapshot(meta, tokens, state, self.dims.vocab_size, self.context_length,
                                        None if self.hybrid else self.runner.slot_shapes)

    # ---- info ---------------------------------------------------------------------------------------
    def model_info(self) -> dict:
        c = self.cfg
        # absolute: a router started in another directory must not take a relative path for a hub model id
        return {"model_path": str(Path(c.model).resolve()), "tokenizer_path": str(Path(c.tokenizer or c.model).resolve()),
                "served_model_name": self.model_name,
                "is_generation": True, "architecture": self.architecture.name, "context_length": self.context_length}

    async def server_info(self) -> dict:
        c = self.cfg
        return {"model_path": str(Path(c.model).resolve()), "served_model_name": self.model_name, "dtype": str(self.dtype).split(".")[-1],
                "state_dtype": c.state_dtype, "device": str(self.device), "context_length": self.context_length,
                "tensor_parallel_size": c.tensor_parallel_size,
                "max_running_requests": self.scheduler.max_running, "chunked_prefill_size": c.chunked_prefill_size,
                "mamba_cache_size": self.pool.allocator.capacity, "disable_radix_cache": c.disable_radix_cache,
                "page_size": c.page_size, "mamba_cache_strategy": c.mamba_cache_strategy,
                "mamba_track_interval": self.track_interval, "version": package_version(),
                "internal_states": [await self.accounting()]}


class Generation:
    """A submitted request's outputs, as an async iterator. It ends after the final output; closed
    before that (the client went away, the consumer stopped), it aborts the request, which frees its
    slot at the next step boundary."""

    def __init__(self, engine: Engine, req: Req, outputs: asyncio.Queue):
        # ``req`` belongs to the scheduler thread: kept only to link the copies of generate_n to it
        self._engine, self.req, self.rid, self._outputs = engine, req, req.rid, outputs
        self._open = True

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> StepOutput:
        if not self._open:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if out.finished:
            self._end(abort=False)
        return out

    async def aclose(self) -> None:
        self._end(abort=True)

    def __del__(self) -> None:  # never consumed nor closed: the request must not run on unobserved
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if self._open:
            self._open = False
            self._engine._active -= 1
            if abort:
                self._engine.abort(self.rid)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mambaserve")
    except PackageNotFoundError:
        return "0+unknown"


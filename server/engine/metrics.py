"""Prometheus metrics of one server (names in docs/server-interface.md). Each server gets its own
registry so several engines in one process (tests) do not collide."""

from __future__ import annotations

import collections
import time

from mambaserve.server.engine.timeline import STAGES
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `_created` series double the scrape size and no dashboard uses them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
STORAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class ServerMetrics:
    def __init__(self, hit_rate_window_s: float = 300.0):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mambaserve_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("mambaserve_requests_rejected", "Requests refused before running", ["reason"],
                                registry=r)
        self.non_finite = Counter("mambaserve_non_finite_rows",
                                  "Requests failed alone because their row of a step had no finite distribution: "
                                  "the model's logits (its state or input) or its sampling parameters", ["source"],
                                  registry=r)
        self.reclaimed = Counter("mambaserve_reclaimed_after_failure",
                                 "State slots and KV pages that a failed step had taken and nobody held, returned to "
                                 "the free lists after it (each one a bug worth reporting)", ["resource"], registry=r)
        self.prompt_tokens = Counter("mambaserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("mambaserve_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("mambaserve_num_running_requests", "Requests holding a state slot", registry=r)
        self.waiting = Gauge("mambaserve_num_waiting_requests", "Requests queued for admission", registry=r)
        self.ttft = Histogram("mambaserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mambaserve_inter_token_latency_seconds", "Time between output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.stages = Histogram("mambaserve_request_stage_seconds",
                                "Time to first byte by stage: from the stage before to this one (engine.timeline)",
                                ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.burst_hold = Histogram("mambaserve_burst_hold_seconds",
                                    "How long an idle server held a step for requests still arriving at the HTTP "
                                    "edge (--burst-hold-ms), so that a burst ran as one step", buckets=STAGE_BUCKETS,
                                    registry=r)
        self.gc_pause = Histogram("mambaserve_gc_pause_seconds",
                                  "Garbage collections of the serving process, which stop every thread of it, by "
                                  "generation (engine/gc_pauses.py)", ["generation"], buckets=STAGE_BUCKETS, registry=r)
        self.e2e = Histogram("mambaserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.slots_total = Gauge("mambaserve_state_slots_total", "State slots in the pool", registry=r)
        self.slots_used = Gauge("mambaserve_state_slots_used", "State slots in use", registry=r)
        self.slots_evictable = Gauge("mambaserve_state_slots_evictable",
                                     "Used slots that eviction could free (cached snapshots not in use, hybrids' "
                                     "rolling decode snapshots)", registry=r)
        # hybrid models' paged KV cache (0 pages for pure Mamba2)
        self.kv_pages_total = Gauge("mambaserve_kv_pages_total", "KV pages of the attention layers (hybrid models)",
                                    registry=r)
        self.kv_pages_used = Gauge("mambaserve_kv_pages_used",
                                   "KV pages in use: held by running requests and idle sessions, or cached by the radix "
                                   "cache", registry=r)
        self.kv_pages_evictable = Gauge("mambaserve_kv_pages_evictable",
                                        "Used KV pages that eviction could free (cached prefixes not in use)",
                                        registry=r)
        # What an inference gateway scores a pod by (docs/server-interface.md, "Inference gateways").
        self.cache_usage = Gauge("mambaserve_cache_usage_ratio",
                                 "Pinned share of the cache memory, 0-1: state slots and (hybrids) KV pages in use "
                                 "less those eviction could free, the fuller pool of the two", registry=r)
        self.cache_config = Gauge("mambaserve_cache_config_info",
                                  "Cache configuration (value 1): tokens per KV page, KV pages (0 for pure Mamba2), "
                                  "state slots, tracked-snapshot interval (0: none)",
                                  ["page_size", "num_pages", "num_state_slots", "mamba_track_interval"], registry=r)
        self.cache_queried = Counter("mambaserve_prefix_cache_queried_tokens",
                                     "Prompt tokens looked up in the prefix cache", registry=r)
        self.cache_hit = Counter("mambaserve_prefix_cache_hit_tokens", "Prompt tokens served from a cache",
                                 ["tier"], registry=r)
        self.capacity_miss = Counter("mambaserve_prefix_cache_capacity_miss_tokens",
                                     "Prompt tokens missed because their cached prefix had been evicted for space "
                                     "(more cache would have hit them)", registry=r)
        self.hit_rate = Gauge("mambaserve_cache_hit_rate",
                              "Hit tokens / queried tokens over a sliding window (convenience)", registry=r)
        self.host_slots_total = Gauge("mambaserve_host_cache_slots_total", "State slots of the host tier", registry=r)
        self.host_slots_used = Gauge("mambaserve_host_cache_slots_used", "Host tier slots holding a snapshot",
                                     registry=r)
        self.tier_bytes = Counter("mambaserve_cache_tier_bytes", "State bytes copied between tiers", ["direction"],
                                  registry=r)
        self.evictions = Counter("mambaserve_cache_evictions", "Snapshots evicted", ["tier"], registry=r)
        self.tier_used_bytes = Gauge("mambaserve_cache_tier_used_bytes",
                                     "Bytes of state snapshots each cache tier holds", ["tier"], registry=r)
        self.tier_capacity_bytes = Gauge("mambaserve_cache_tier_capacity_bytes",
                                         "Bytes each cache tier may hold (storage: --storage-size, else free disk "
                                         "less a margin)", ["tier"], registry=r)
        self.storage_entries = Gauge("mambaserve_cache_storage_entries",
                                     "Entries of this model in the storage tier's directory", registry=r)
        self.storage_load_seconds = Histogram("mambaserve_cache_storage_load_seconds",
                                              "Time to read one snapshot from the storage tier into host memory",
                                              buckets=STORAGE_BUCKETS, registry=r)
        self.storage_write_seconds = Histogram("mambaserve_cache_storage_write_seconds",
                                               "Time to write one snapshot from host memory to the storage tier",
                                               buckets=STORAGE_BUCKETS, registry=r)
        self.storage_rejected = Counter("mambaserve_cache_storage_rejected_entries",
                                        "Storage entries refused: corrupt or invalid (deleted), or incompatible with "
                                        "this model",
                                        ["reason"], registry=r)
        self.storage_read_only = Gauge("mambaserve_cache_storage_read_only",
                                       "1 while the storage tier's directory refuses writes (full, over a quota, a "
                                       "read-only filesystem) but is still read: entries and persisted sessions "
                                       "restore, nothing new is written", registry=r)
        self.session_turns_not_persisted = Counter(
            "mambaserve_session_turns_not_persisted",
            "--session-persist: session turns that could not be written (storage read-only or off, or the write "
            "failed), answered all the same: a restart resumes such a session from its last written turn", registry=r)
        self.storage_degraded = Gauge("mambaserve_cache_storage_degraded",
                                      "1 while the storage tier writes nothing because its directory is full, "
                                      "read-only or gone (requests are served from the tiers above; a full or "
                                      "read-only one is still read: mambaserve_cache_storage_read_only)", registry=r)
        self.sessions_open = Gauge("mambaserve_sessions_open", "Open sessions", registry=r)
        self.session_held_slots = Gauge("mambaserve_session_held_slots",
                                        "State slots held by streaming sessions between turns", registry=r)
        self.sessions_closed = Counter("mambaserve_sessions_closed", "Closed sessions by reason", ["reason"],
                                       registry=r)
        self.files_rejected = Counter("mambaserve_session_files_rejected",
                                      "Session files refused on reading back (snapshot files, persisted session "
                                      "records), by reason: corrupt, incompatible, tokens, too_long, empty, fields, "
                                      "state", ["file", "reason"], registry=r)
        self.session_restores = Counter("mambaserve_session_restores",
                                        "Sessions restored from a snapshot file or a persisted record, by result: "
                                        "loaded (its state read back), recomputed (its history prefilled again), "
                                        "rejected (a record refused)", ["result"], registry=r)
        self.drain_seconds = Gauge("mambaserve_drain_seconds",
                                   "Seconds since a signal started this server's drain (0 while serving; its last "
                                   "value when the drain ended, just before the server exits)", registry=r)
        self.session_restore_seconds = Histogram("mambaserve_session_restore_seconds",
                                                 "Time from a turn naming a persisted session this server did not "
                                                 "know to that session recreated, its state loaded",
                                                 buckets=STORAGE_BUCKETS, registry=r)
        self.kernel_compiles = Counter("mambaserve_kernel_compiles",
                                       "Triton kernel compiles in this process (loads from the on-disk cache "
                                       "included): before the server reported ready (warmup), after it (serving: "
                                       "requests waited for it; should stay 0)", ["phase"], registry=r)
        # Every label value exists from the start, at 0: a ratio of counters (hit rate in PromQL, the
        # autoscaler's miss ratio) must not vanish on a pod that has had no hit yet.
        for tier in ("gpu", "host", "storage", "session"):
            self.cache_hit.labels(tier)
        for tier in ("gpu", "host", "storage"):
            self.evictions.labels(tier)
            self.tier_used_bytes.labels(tier)
            self.tier_capacity_bytes.labels(tier)
        for direction in ("gpu_to_host", "host_to_gpu", "host_to_storage", "storage_to_host"):
            self.tier_bytes.labels(direction)
        for reason in ("corrupt", "invalid", "incompatible"):
            self.storage_rejected.labels(reason)
        for stage in STAGES[1:]:
            self.stages.labels(stage)
        for reason in ("client", "timeout", "error"):
            self.sessions_closed.labels(reason)
        for result in ("loaded", "recomputed", "rejected"):
            self.session_restores.labels(result)
        for file in ("snapshot", "record"):  # a series per kind of file from the start: the panel shows 0, not nothing
            self.files_rejected.labels(file, "corrupt")
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        for phase in ("warmup", "serving"):
            self.kernel_compiles.labels(phase)
        for source in ("logits", "sampling"):
            self.non_finite.labels(source)
        for resource in ("state_slots", "kv_pages"):
            self.reclaimed.labels(resource)
        self._window: collections.deque[tuple[float, int, int]] = collections.deque()
        self._window_s = hit_rate_window_s
        self._window_sums = [0, 0]  # queried, hit: kept with the window (a sum over it per lookup grew with the load)

    def watch_connections(self, guard) -> None:
        """The HTTP edge's connections (``api.connections.ConnectionGuard``), read at each scrape."""
        self.registry.register(_ConnectionCollector(guard))

    def observe_cache_config(self, *, page_size: int, num_pages: int, num_state_slots: int,
                             track_interval: int) -> None:
        """Once, when the pools are built."""
        self.cache_config.labels(str(page_size), str(num_pages), str(num_state_slots), str(track_interval)).set(1)
        self.slots_total.set(num_state_slots)
        self.kv_pages_total.set(num_pages)

    def observe_pools(self, *, slots_used: int, slots_evictable: int, slots_total: int, pages_used: int = 0,
                      pages_evictable: int = 0, pages_total: int = 0) -> None:
        self.slots_used.set(slots_used)
        self.slots_evictable.set(slots_evictable)
        self.kv_pages_used.set(pages_used)
        self.kv_pages_evictable.set(pages_evictable)
        self.cache_usage.set(max(pinned_share(slots_used, slots_evictable, slots_total),
                                 pinned_share(pages_used, pages_evictable, pages_total)))

    def observe_lookup(self, queried: int, hit: int, tier: str = "gpu", capacity_miss: int = 0) -> None:
        self.cache_queried.inc(queried)
        if hit:
            self.cache_hit.labels(tier).inc(hit)
        if capacity_miss:
            self.capacity_miss.inc(capacity_miss)
        now = time.monotonic()
        sums = self._window_sums
        self._window.append((now, queried, hit))
        sums[0] += queried
        sums[1] += hit
        while self._window[0][0] < now - self._window_s:
            _, q, h = self._window.popleft()
            sums[0] -= q
            sums[1] -= h
        self.hit_rate.set(sums[1] / sums[0] if sums[0] else 0.0)


class _ConnectionCollector:
    def __init__(self, guard):
        self.guard = guard

    def collect(self):
        yield GaugeMetricFamily("mambaserve_http_connections", "Open HTTP connections", value=self.guard.open())
        refused = CounterMetricFamily("mambaserve_http_connections_refused",
                                      "HTTP requests refused at the edge: read deadline passed (408) or too many "
                                      "connections open (503)", labels=["reason"])
        for reason, n in self.guard.refused.items():
            refused.add_metric([reason], n)
        yield refused


def pinned_share(used: int, evictable: int, total: int) -> float:
    """Share of a pool that eviction cannot free (0 for an empty pool): what admission waits on. Cached
    entries nobody uses count as free, as in vLLM's and SGLang's KV usage gauges."""
    return (used - evictable) / total if total else 0.0

#!/usr/bin/env python3
"""Writes the chart's Grafana dashboards (charts/mambaserve/dashboards/*.json) from the panel list below.

The JSON files are the shipped artifact and are checked in; this script is how they are authored.
`--check` exits 1 when the checked-in JSON differs from what the script builds (tests/charts runs it).

Series labels: `namespace` and `pod` come from prometheus-operator's scrape, `mambaserve_io_session`
from the session label (podTargetLabels), as with the chart's PodMonitor and the operator's
ServiceMonitors. Only metric names the server or the operator export appear here (tests/charts
collects them from a live server and operator and compares), and every family the server exports has
a panel.

    .venv/bin/python scripts/build_dashboards.py          # rewrite the JSON
    .venv/bin/python scripts/build_dashboards.py --check  # fail if it is stale
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass, field

OUT = pathlib.Path(__file__).resolve().parents[1] / "charts" / "mambaserve" / "dashboards"

SEL = 'namespace=~"$namespace", mambaserve_io_session=~"$session"'
RATE = "$__rate_interval"
# The HPA's metric as prometheus-adapter serves it (files/prometheus-adapter-rules.yaml): a fixed
# 2m window, per pod. Keep in step with the operator's RATE_WINDOW.
HPA_WINDOW = "2m"

HIT = "mambaserve_prefix_cache_hit_tokens_total"
QUERIED = "mambaserve_prefix_cache_queried_tokens_total"


def rate(metric: str, by: str = "", sel: str = SEL, window: str = RATE) -> str:
    inner = f"rate({metric}{{{sel}}}[{window}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def hits(by: str = "", sel: str = SEL, window: str = RATE) -> str:
    """Hit-token rate that is 0 (not absent) while nothing has hit yet: the counter is labelled by
    tier, so it has no series at all until the first hit."""
    return f"({rate(HIT, by, sel, window)} or {rate(QUERIED, by, sel, window)} * 0)"


def hit_rate(by: str = "", sel: str = SEL, window: str = RATE) -> str:
    return f"{hits(by, sel, window)} / {rate(QUERIED, by, sel, window)}"


def quantile(q: float, metric: str, by: str = "") -> str:
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))"


@dataclass
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    width: int = 12
    height: int = 8
    min: float | None = 0
    max: float | None = None
    stack: bool = False
    decimals: int | None = None
    text_mode: str = "auto"  # stat panels: "name" shows the legend (an info metric's labels), not the value
    thresholds: list[tuple[float | None, str]] = field(default_factory=list)


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    panels: list[Panel]
    session_vars: bool = True
    extra_vars: list[dict] = field(default_factory=list)


def T(expr: str, legend: str = "") -> Target:  # noqa: N802 - reads like a table row below
    return Target(expr, legend)


S = "{{namespace}}/{{mambaserve_io_session}}"
SESSION_TIER = SEL + ', tier="session"'
POD = "{{namespace}}/{{pod}}"

OVERVIEW = Dashboard("mambaserve-overview", "mambaserve / Overview",
                     "Traffic, latency and queues of every InferenceSession's server pods.", [
    Panel("Requests / s", "Finished requests per second.", [T(rate("mambaserve_requests_total"))],
          unit="reqps", kind="stat", width=5, height=4, decimals=2),
    Panel("Prefix-cache hit rate", "Prompt tokens served from cached states / prompt tokens looked up.",
          [T(hit_rate())], unit="percentunit", kind="stat", width=5, height=4, max=1,
          thresholds=[(None, "red"), (0.3, "orange"), (0.5, "green")]),
    Panel("TTFT p99", "99th percentile time to first token over all pods.",
          [T(quantile(0.99, "mambaserve_time_to_first_token_seconds"))], unit="s", kind="stat", width=5, height=4,
          thresholds=[(None, "green"), (1, "orange"), (2, "red")]),
    Panel("Server pods", "Server pods Prometheus scrapes (replicas serving).",
          [T(f"count(mambaserve_state_slots_total{{{SEL}}})")], kind="stat", width=4, height=4, decimals=0),
    Panel("Waiting requests", "Requests queued for a state slot, all pods.",
          [T(f"sum(mambaserve_num_waiting_requests{{{SEL}}})")], kind="stat", width=5, height=4, decimals=0,
          thresholds=[(None, "green"), (1, "orange"), (16, "red")]),
    Panel("Requests by finish reason", "Finished requests per second: stop, length, abort, error.",
          [T(rate("mambaserve_requests_total", "finish_reason"), "{{finish_reason}}")], unit="reqps", stack=True),
    Panel("Rejected requests by reason", "Requests refused before running (bad_request, too_long, overloaded).",
          [T(rate("mambaserve_requests_rejected_total", "reason"), "{{reason}}")], unit="reqps", stack=True),
    Panel("Time to first token", "From arrival to the first output token (queueing + prefill).", [
        T(quantile(0.5, "mambaserve_time_to_first_token_seconds"), "p50"),
        T(quantile(0.9, "mambaserve_time_to_first_token_seconds"), "p90"),
        T(quantile(0.99, "mambaserve_time_to_first_token_seconds"), "p99")], unit="s"),
    Panel("Inter-token latency", "Time between consecutive output tokens of a request (decode step time).", [
        T(quantile(0.5, "mambaserve_inter_token_latency_seconds"), "p50"),
        T(quantile(0.9, "mambaserve_inter_token_latency_seconds"), "p90"),
        T(quantile(0.99, "mambaserve_inter_token_latency_seconds"), "p99")], unit="s"),
    Panel("End-to-end request latency", "From arrival to the last token.", [
        T(quantile(0.5, "mambaserve_e2e_request_latency_seconds"), "p50"),
        T(quantile(0.99, "mambaserve_e2e_request_latency_seconds"), "p99")], unit="s"),
    Panel("Token throughput", "Prompt tokens admitted and tokens generated per second.", [
        T(rate("mambaserve_prompt_tokens_total"), "prompt"),
        T(rate("mambaserve_generation_tokens_total"), "generated")], unit="short"),
    Panel("Running and waiting requests", "Requests holding a state slot, and requests queued for one.", [
        T(f"sum by (namespace, mambaserve_io_session) (mambaserve_num_running_requests{{{SEL}}})", f"running {S}"),
        T(f"sum by (namespace, mambaserve_io_session) (mambaserve_num_waiting_requests{{{SEL}}})", f"waiting {S}")]),
    Panel("Server pods per session", "Scraped server pods of each InferenceSession.",
          [T(f"count by (namespace, mambaserve_io_session) (mambaserve_state_slots_total{{{SEL}}})", S)], decimals=0),
    Panel("Time to first byte by stage", "Mean share of each stage of a request's time to its first byte "
          "(mambaserve_request_stage_seconds): validated, queued, admitted, launched, first_token, finished "
          "(non-streamed answers), first_byte.",
          [T(f"{rate('mambaserve_request_stage_seconds_sum', 'stage')} / "
             f"{rate('mambaserve_request_stage_seconds_count', 'stage')}", "{{stage}}")], unit="s", stack=True),
    Panel("HTTP connections", "Open HTTP connections per pod (against --max-connections), and requests refused at "
          "the edge per second: 408 (headers or body not in within --http-header-timeout / --http-body-timeout) "
          "or 503 (too many connections).", [
        T(f"mambaserve_http_connections{{{SEL}}}", f"open {POD}"),
        T(rate("mambaserve_http_connections_refused_total", "reason"), "refused: {{reason}}")]),
    Panel("Requests failed alone", "Requests per second failed by themselves because their row of a step had no "
          "finite distribution (source: the model's logits, or the request's sampling values); their neighbours "
          "went on. And state slots or KV pages a failed step had taken that nobody held, given back after it "
          "(each one a bug worth reporting).", [
        T(rate("mambaserve_non_finite_rows_total", "source"), "non-finite: {{source}}"),
        T(rate("mambaserve_reclaimed_after_failure_total", "resource"), "reclaimed: {{resource}}")], unit="ops"),
    Panel("Held steps and garbage collections", "Seconds per second, per pod: an idle server holding its next "
          "step for requests still arriving (--burst-hold-ms: a client's burst then runs as one step), and garbage "
          "collections, which stop every thread of the server, by generation (what start-up left alive is frozen "
          "once the server is ready, so these stay short).", [
        T(rate("mambaserve_burst_hold_seconds_sum", "namespace, pod"), f"held {POD}"),
        T(rate("mambaserve_gc_pause_seconds_sum", "namespace, pod, generation"), f"gc gen {{{{generation}}}} {POD}")],
          unit="s"),
    Panel("Kernel compiles while serving", "Triton kernels compiled after each pod reported ready, since it "
          "started (the warm-up compiles every variant a request can reach before then: a compile here stalled the "
          "running requests for seconds; the server log names the kernel).",
          [T(f"sum(mambaserve_kernel_compiles_total{{{SEL}, phase=\"serving\"}})")],
          kind="stat", width=6, height=4, decimals=0, thresholds=[(None, "green"), (1, "red")]),
])

CACHE = Dashboard("mambaserve-cache", "mambaserve / Cache",
                  "Prefix-cache hit rate (overall and by tier), state-slot and KV page pools, evictions.", [
    Panel("Hit rate", "Prompt tokens served from cached states / prompt tokens looked up, from the counters.", [
        T(hit_rate(), "all sessions"),
        T(hit_rate("namespace, mambaserve_io_session"), S)], unit="percentunit", max=1),
    Panel("Hit rate by tier", "Share of looked-up prompt tokens served by each tier: gpu (radix cache), "
          "session (a streaming session's live state), host and storage (when those tiers are enabled).",
          [T(f"{rate(HIT, 'tier')} / ignoring(tier) group_left() {rate(QUERIED)}", "{{tier}}")],
          unit="percentunit", max=1, stack=True),
    Panel("Prompt tokens: cached vs computed", "Per second: prompt tokens served from each tier, and those prefilled.", [
        T(rate(HIT, "tier"), "cached ({{tier}})"),
        T(f"{rate(QUERIED)} - {hits()}", "computed")], stack=True),
    Panel("Cache evictions by tier", "Cached snapshots evicted per second to make room.",
          [T(rate("mambaserve_cache_evictions_total", "tier"), "{{tier}}")], unit="ops"),
    Panel("State slots", "Slot pool of all selected pods: capacity, used, and the used slots eviction could free.", [
        T(f"sum(mambaserve_state_slots_total{{{SEL}}})", "total"),
        T(f"sum(mambaserve_state_slots_used{{{SEL}}})", "used"),
        T(f"sum(mambaserve_state_slots_evictable{{{SEL}}})", "evictable (cached snapshots)"),
        T(f"sum(mambaserve_session_held_slots{{{SEL}}})", "held by sessions")], decimals=0),
    Panel("KV pages (hybrid models)", "Paged KV cache of the attention layers of all selected pods: capacity, "
          "pages in use (running requests reserve their prompt + max_new_tokens at admission; the radix cache "
          "keeps cached prefixes' pages), and the used pages eviction could free. Zero for pure Mamba2 models.", [
        T(f"sum(mambaserve_kv_pages_total{{{SEL}}})", "total"),
        T(f"sum(mambaserve_kv_pages_used{{{SEL}}})", "used"),
        T(f"sum(mambaserve_kv_pages_evictable{{{SEL}}})", "evictable (cached prefixes)")], decimals=0),
    Panel("Pinned share of the pool per pod", "(used - evictable) / total: slots eviction cannot free, and for "
          "hybrid models KV pages. Near 100% with waiting requests is the StatePoolExhausted / KVPoolExhausted "
          "alert.", [
        T(f"(mambaserve_state_slots_used{{{SEL}}} - mambaserve_state_slots_evictable{{{SEL}}}) "
          f"/ mambaserve_state_slots_total{{{SEL}}}", f"slots {POD}"),
        # clamp: 0 (not 0/0) for pure Mamba2 pods, which have no pages
        T(f"(mambaserve_kv_pages_used{{{SEL}}} - mambaserve_kv_pages_evictable{{{SEL}}}) "
          f"/ clamp_min(mambaserve_kv_pages_total{{{SEL}}}, 1)", f"KV pages {POD}")], unit="percentunit", max=1),
    Panel("Cache usage per pod (gateway KV utilisation)", "mambaserve_cache_usage_ratio: the pinned share of the "
          "fuller pool (state slots, or a hybrid's KV pages). What an inference gateway's KV-cache utilisation "
          "scorer reads (docs/server-interface.md).",
          [T(f"mambaserve_cache_usage_ratio{{{SEL}}}", POD)], unit="percentunit", max=1),
    Panel("Cache configuration per pod", "mambaserve_cache_config_info: tokens per KV page, KV pages (0 for pure "
          "Mamba2), state slots and the tracked-snapshot interval of each pod.",
          [T(f"mambaserve_cache_config_info{{{SEL}}}", "{{pod}}: page_size {{page_size}}, {{num_pages}} KV pages, "
             "{{num_state_slots}} slots, track interval {{mamba_track_interval}}")],
          kind="stat", text_mode="name", decimals=0),
    Panel("Evictions per finished request", "Evictions / finished requests per pod; above ~2 cached states rarely "
          "live long enough to be reused (CacheThrashing alert).",
          [T(f"{rate('mambaserve_cache_evictions_total', 'namespace, pod')} / "
             f"{rate('mambaserve_requests_total', 'namespace, pod')}", POD)]),
    Panel("Hit rate per pod (server's sliding window)", "The server's own windowed hit rate gauge per pod "
          "(what the operator reports in InferenceSession status).",
          [T(f"mambaserve_cache_hit_rate{{{SEL}}}", POD)], unit="percentunit", max=1),
    Panel("Misses: capacity vs compulsory", "Missed prompt tokens per second: those whose cached prefix had been "
          "evicted for space (more cache or replicas would have hit them), and the rest (never seen).", [
        T(rate("mambaserve_prefix_cache_capacity_miss_tokens_total"), "capacity"),
        T(f"{rate(QUERIED)} - {hits()} - {rate('mambaserve_prefix_cache_capacity_miss_tokens_total')}",
          "compulsory")], stack=True),
    Panel("Host tier occupancy per pod", "Snapshots in the host cache tier (--host-cache-size) / its capacity.",
          [T(f"mambaserve_host_cache_slots_used{{{SEL}}} / mambaserve_host_cache_slots_total{{{SEL}}}", POD)],
          unit="percentunit", max=1),
    Panel("Bytes moved between tiers", "State bytes copied from the GPU to the host tier (evicted snapshots kept) "
          "and back (host hits), and between the host and the storage tier (writes, and reads of prefixes found "
          "on storage only).", [T(rate("mambaserve_cache_tier_bytes_total", "direction"), "{{direction}}")],
          unit="Bps"),
    Panel("Tier occupancy", "Bytes of state snapshots each tier holds, and what it may hold (storage: "
          "--storage-size, else the free disk less a margin), all selected pods.", [
        T(f"sum by (tier) (mambaserve_cache_tier_used_bytes{{{SEL}}})", "used ({{tier}})"),
        T(f"sum by (tier) (mambaserve_cache_tier_capacity_bytes{{{SEL}}})", "capacity ({{tier}})")], unit="bytes"),
    Panel("Storage tier fill per pod", "Storage bytes / capacity as each pod sees them (pods sharing a volume see "
          "the same directory). Near 100% least recently used entries are deleted for every write "
          "(StorageTierNearCapacity alert).",
          [T(f"mambaserve_cache_tier_used_bytes{{{SEL}, tier=\"storage\"}} "
             f"/ mambaserve_cache_tier_capacity_bytes{{{SEL}, tier=\"storage\"}} > 0", POD)],
          unit="percentunit", max=1),
    Panel("Storage reads and writes", "Snapshots read from (prefetches) and written to the storage tier per "
          "second, and the entries of this model it holds.", [
        T(rate("mambaserve_cache_storage_load_seconds_count"), "reads / s"),
        T(rate("mambaserve_cache_storage_write_seconds_count"), "writes / s"),
        T(f"sum(mambaserve_cache_storage_entries{{{SEL}}})", "entries")]),
    Panel("Storage latency", "p50 and p99 time to read one snapshot from storage into host memory, and to write "
          "one (both on the storage thread, never on the decode path).", [
        T(quantile(0.5, "mambaserve_cache_storage_load_seconds"), "read p50"),
        T(quantile(0.99, "mambaserve_cache_storage_load_seconds"), "read p99"),
        T(quantile(0.5, "mambaserve_cache_storage_write_seconds"), "write p50"),
        T(quantile(0.99, "mambaserve_cache_storage_write_seconds"), "write p99")], unit="s"),
    Panel("Storage entries rejected", "Entries refused per second: corrupt (checksum or size wrong: deleted) or "
          "incompatible (another model, weights, dtype or layout on the same volume: never loaded).",
          [T(rate("mambaserve_cache_storage_rejected_entries_total", "reason"), "{{reason}}")], unit="ops"),
    Panel("Storage tier degraded", "Pods whose storage tier writes nothing because its directory is full, "
          "read-only or gone (they serve from the GPU and host tiers).",
          [T(f"sum(mambaserve_cache_storage_degraded{{{SEL}}})")], kind="stat", width=6, height=4, decimals=0,
          thresholds=[(None, "green"), (1, "red")]),
    Panel("Storage tier read-only", "Of those, pods whose storage directory refuses writes (full, over a quota) "
          "but is still read: stored prefixes and persisted sessions restore, nothing new is written.",
          [T(f"sum(mambaserve_cache_storage_read_only{{{SEL}}})")], kind="stat", width=6, height=4, decimals=0,
          thresholds=[(None, "green"), (1, "orange")]),
])

SESSIONS = Dashboard("mambaserve-sessions", "mambaserve / Sessions",
                     "Streaming sessions: open, state slots they hold, how they close, restores.", [
    Panel("Open sessions", "Open sessions, all selected pods.", [T(f"sum(mambaserve_sessions_open{{{SEL}}})")],
          kind="stat", width=8, height=4, decimals=0),
    Panel("Slots held by sessions", "State slots streaming sessions keep between turns.",
          [T(f"sum(mambaserve_session_held_slots{{{SEL}}})")], kind="stat", width=8, height=4,
          decimals=0),
    Panel("Session-state hit rate", "Share of looked-up prompt tokens served from a streaming session's live state.",
          [T(f"{rate(HIT, sel=SESSION_TIER)} / {rate(QUERIED)}")], unit="percentunit", kind="stat",
          width=8, height=4, max=1),
    Panel("Open sessions per pod", "Open sessions on each server pod.",
          [T(f"mambaserve_sessions_open{{{SEL}}}", POD)], decimals=0),
    Panel("Held slots per pod", "Slots held by sessions on each pod, as a share of its pool.",
          [T(f"mambaserve_session_held_slots{{{SEL}}} / mambaserve_state_slots_total{{{SEL}}}", POD)],
          unit="percentunit", max=1),
    Panel("Sessions closed by reason", "Closed sessions per second: client, timeout, error.",
          [T(rate("mambaserve_sessions_closed_total", "reason"), "{{reason}}")], unit="ops", stack=True),
    Panel("Session restores", "Sessions restored per second (migrations between pods, restarts) from a snapshot "
          "file or a --session-persist record, by result: loaded (state read back), recomputed (history prefilled "
          "again), rejected; and the seconds per second spent restoring persisted sessions (over the restores' rate: "
          "the mean restore time).", [
        T(rate("mambaserve_session_restores_total", "result"), "{{result}}"),
        T(rate("mambaserve_session_restore_seconds_sum"), "seconds restoring")], unit="ops"),
    Panel("Session turns not persisted", "--session-persist: session turns per second that could not be "
          "written (storage full, read-only or gone): a restart resumes those sessions from an earlier turn.",
          [T(rate("mambaserve_session_turns_not_persisted_total", "namespace, mambaserve_io_session"), S)],
          unit="ops"),
    Panel("Session files refused", "Snapshot files and persisted session records refused on reading back, per "
          "second, by file and reason (corrupt, incompatible, tokens, too_long, empty, fields, state).",
          [T(rate("mambaserve_session_files_rejected_total", "file, reason"), "{{file}}: {{reason}}")], unit="ops"),
    Panel("Drain time per pod", "Seconds each stopping pod has drained so far (SIGTERM: in-flight turns finish, "
          "open sessions are written to storage; 0 while serving); a line nearing the pod's --drain-timeout is a "
          "stream about to be cut.", [T(f"mambaserve_drain_seconds{{{SEL}}}", POD)], unit="s"),
])

_TARGETS = ("0.02", "0.05", "0.1", "0.2", "0.3", "0.5")
TARGET_VAR = {
    "type": "custom", "name": "target_capacity_miss_ratio", "label": "Target capacity-miss ratio",
    "description": "The InferenceSession's spec.autoscaling.targetCapacityMissRatio (CRD default 0.1); "
                   "Prometheus does not know it, so pick it here.",
    "query": ",".join(_TARGETS),
    "current": {"text": "0.1", "value": "0.1"},
    "options": [{"text": v, "value": v, "selected": v == "0.1"} for v in _TARGETS],
    "hide": 0,
}

_CAPACITY_MISSES = "mambaserve_prefix_cache_capacity_miss_tokens_total"
_BY_POD = "namespace, mambaserve_io_session, pod"
_POD_CAPACITY_MISS = (f"{rate(_CAPACITY_MISSES, _BY_POD, window=HPA_WINDOW)} / "
                      f"{rate(QUERIED, _BY_POD, window=HPA_WINDOW)}")

AUTOSCALING = Dashboard("mambaserve-autoscaling", "mambaserve / Autoscaling",
                        "What the autoscaler sees: the capacity-miss ratio (misses more cache would have hit) per "
                        "pod against the target, serving replicas, and the replica count the HPA formula asks for.", [
    Panel("Replicas: serving vs HPA formula", "Serving = scraped server pods. Desired = ceil(sum of pod capacity-miss "
          "ratios / target), the HPA's rule for a Pods metric with an AverageValue target, before min/max replicas "
          "and its 10% tolerance. The HPA's own desiredReplicas needs kube-state-metrics.", [
        T(f"count by (namespace, mambaserve_io_session) (mambaserve_state_slots_total{{{SEL}}})", f"serving {S}"),
        T(f"ceil(sum by (namespace, mambaserve_io_session) ({_POD_CAPACITY_MISS}) / $target_capacity_miss_ratio)",
          f"desired {S}")], decimals=0),
    Panel("Misses: capacity vs compulsory", "Share of prompt tokens that missed because their prefix had been "
          "evicted for space (more replicas would hit them) and that missed because the prefix was never seen "
          "(no replica count helps). Only the first drives autoscaling.", [
        T(f"{rate(_CAPACITY_MISSES, 'namespace, mambaserve_io_session', window=HPA_WINDOW)} / "
          f"{rate(QUERIED, 'namespace, mambaserve_io_session', window=HPA_WINDOW)}", f"capacity {S}"),
        T(f"1 - {hit_rate('namespace, mambaserve_io_session', window=HPA_WINDOW)} - "
          f"{rate(_CAPACITY_MISSES, 'namespace, mambaserve_io_session', window=HPA_WINDOW)} / "
          f"{rate(QUERIED, 'namespace, mambaserve_io_session', window=HPA_WINDOW)}", f"compulsory {S}"),
        T("vector($target_capacity_miss_ratio)", "target")], unit="percentunit", max=1),
    Panel("Capacity-miss ratio per pod (HPA metric)", "mambaserve_cache_capacity_miss_ratio as prometheus-adapter "
          "computes it for the HPA: the HPA adds pods while the average is above the target.", [
        T(_POD_CAPACITY_MISS, POD),
        T("vector($target_capacity_miss_ratio)", "HPA target")], unit="percentunit", max=1),
    Panel("Waiting requests per pod (HPA queue metric)", "The second HPA metric when targetQueueDepth is set.",
          [T(f"mambaserve_num_waiting_requests{{{SEL}}}", POD)], decimals=0),
])

OPERATOR = Dashboard("mambaserve-operator", "mambaserve / Operator",
                     "Reconciliations of InferenceSessions and CacheTiers: rate, errors, duration.", [
    Panel("Reconciles / s", "All reconciliations per second.",
          [T("sum(rate(mambaserve_operator_reconciles_total[$__rate_interval]))")], unit="ops", kind="stat",
          width=8, height=4, decimals=2),
    Panel("Error ratio", "Failed / all reconciliations.",
          [T("sum(rate(mambaserve_operator_reconcile_errors_total[$__rate_interval])) / "
             "sum(rate(mambaserve_operator_reconciles_total[$__rate_interval]))")],
          unit="percentunit", kind="stat", width=8, height=4, max=1,
          thresholds=[(None, "green"), (0.01, "orange"), (0.1, "red")]),
    Panel("Reconcile p99", "99th percentile reconcile duration over all kinds.",
          [T("histogram_quantile(0.99, sum by (le) "
             "(rate(mambaserve_operator_reconcile_duration_seconds_bucket[$__rate_interval])))")],
          unit="s", kind="stat", width=8, height=4),
    Panel("Reconciles by kind and result", "Per second, by kind (InferenceSession, CacheTier) and result.",
          [T("sum by (kind, result) (rate(mambaserve_operator_reconciles_total[$__rate_interval]))",
             "{{kind}} {{result}}")], unit="ops"),
    Panel("Reconcile errors by kind", "Failed reconciliations per second; Kopf retries them with backoff.",
          [T("sum by (kind) (rate(mambaserve_operator_reconcile_errors_total[$__rate_interval]))", "{{kind}}")],
          unit="ops"),
    Panel("Reconcile duration", "p50 and p99 per kind (API calls plus scraping the pods' /metrics).", [
        T("histogram_quantile(0.5, sum by (kind, le) "
          "(rate(mambaserve_operator_reconcile_duration_seconds_bucket[$__rate_interval])))", "p50 {{kind}}"),
        T("histogram_quantile(0.99, sum by (kind, le) "
          "(rate(mambaserve_operator_reconcile_duration_seconds_bucket[$__rate_interval])))", "p99 {{kind}}")],
          unit="s"),
], session_vars=False)

DASHBOARDS = {"overview": OVERVIEW, "cache": CACHE, "sessions": SESSIONS, "autoscaling": AUTOSCALING,
              "operator": OPERATOR}

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variables(d: Dashboard) -> list[dict]:
    out: list[dict] = [{"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
                        "current": {}, "hide": 0, "refresh": 1}]
    if d.session_vars:
        for name, label, query in (
            ("namespace", "Namespace", "label_values(mambaserve_state_slots_total, namespace)"),
            ("session", "InferenceSession",
             'label_values(mambaserve_state_slots_total{namespace=~"$namespace"}, mambaserve_io_session)'),
        ):
            out.append({"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
                        "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
                        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
                        "current": {"text": "All", "value": "$__all"}, "hide": 0})
    return out + d.extra_vars


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": p.unit}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.decimals is not None:
        defaults["decimals"] = p.decimals
    steps = [{"color": c, "value": v} for v, c in p.thresholds] or [{"color": "green", "value": None}]
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not p.stack else 30,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        defaults["color"] = {"mode": "thresholds"}
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": p.text_mode, "justifyMode": "auto"}
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
                     "legendFormat": t.legend or "__auto", "range": True, "instant": False}
                    for i, t in enumerate(p.targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def build(d: Dashboard) -> dict:
    panels, x, y, row_h = [], 0, 0, 0
    for pid, p in enumerate(d.panels, start=1):
        if x + p.width > 24:  # next row
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel(p, pid, x, y))
        x, row_h = x + p.width, max(row_h, p.height)
    return {
        "uid": d.uid, "title": d.title, "description": d.description,
        "tags": ["mambaserve"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "templating": {"list": _variables(d)},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["mambaserve"], "title": "mambaserve", "asDropdown": True}],
        "panels": panels,
    }


AUTOSCALING.extra_vars.append(TARGET_VAR)


def render(name: str) -> str:
    return json.dumps(build(DASHBOARDS[name]), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in JSON is stale")
    args = parser.parse_args()
    stale = []
    for name in DASHBOARDS:
        path = OUT / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale dashboards (run scripts/build_dashboards.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The operator's own Prometheus metrics (names in docs/server-interface.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import kopf
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class OperatorMetrics:
    """One set of collectors per registry, so tests can run several operators in one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter("mambaserve_operator_reconciles_total", "Reconciliations by kind and result.",
                                  ["kind", "result"], registry=self.registry)
        self.errors = Counter("mambaserve_operator_reconcile_errors_total", "Failed reconciliations by kind.",
                              ["kind"], registry=self.registry)
        self.duration = Histogram("mambaserve_operator_reconcile_duration_seconds", "Reconciliation duration.",
                                  ["kind"], registry=self.registry,
                                  buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    @contextlib.contextmanager
    def track(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except kopf.TemporaryError:
            # A deliberate "try again later" (e.g. a CacheTier deletion waiting for its sessions).
            self.reconciles.labels(kind=kind, result="ok").inc()
            raise
        except Exception:
            self.reconciles.labels(kind=kind, result="error").inc()
            self.errors.labels(kind=kind).inc()
            raise
        else:
            self.reconciles.labels(kind=kind, result="ok").inc()
        finally:
            self.duration.labels(kind=kind).observe(time.perf_counter() - start)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

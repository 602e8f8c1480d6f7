"""A server pod's cpu and memory, from what it holds.

The memory a server pod needs is the sum of what it holds in host memory, so it is requested and
limited at that (a limit equal to the request: the pod can never take more than the node reserved for
it, so pinned host memory cannot push a GPU node into OOM)::

    runtime      Python, torch, the CUDA and Triton host libraries           4Gi (GPU) / 2Gi (CPU), per GPU
                 (resources.gpus > 1: one server process per GPU)
    weights      the checkpoint, read into host memory while loading          model.checkpointSize
                 (a CPU pod keeps a second copy: the parameters it serves)
    state pool   CPU only: the state slots and activations live in host RAM  2Gi
    host tier    the CacheTier's pinned host tier                            host.sizeGb GiB
    staging      a storage tier without a host tier stages its reads         2Gi
    pinned       pinned upload/download buffers, CUDA graphs' host side      1Gi per GPU
    /dev/shm     the memory-backed emptyDir, as much as it may hold          its sizeLimit

``Footprint.describe()`` prints that sum; ``mambaserve-operator render`` shows it beside the workload.
A request or limit the spec names is kept as it is (a request below the footprint is reported).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mambaserve.operator.spec import CacheTier, InferenceSession, quantity_bytes

GiB = 2**30
# Requests of a pod whose spec names neither a request nor a limit for cpu. A GPU pod runs the
# scheduler thread, HTTP and tokenization on a few cores (and a process per further GPU, each a core's
# worth of launches); a CPU pod computes on its cores.
DEFAULT_CPU = {True: 4, False: 2}
RUNTIME = {True: 4 * GiB, False: 2 * GiB}
# An unknown checkpoint: a few billion parameters in bf16 on a GPU, a small model on CPU (what CPU pods serve).
UNKNOWN_WEIGHTS = {True: 8 * GiB, False: 1 * GiB}
CPU_STATE_POOL = 2 * GiB
STORAGE_STAGING = 2 * GiB
PINNED_BUFFERS = 1 * GiB


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    source: str = ""  # the spec field it comes from, when there is one

    def describe(self) -> str:
        return f"{self.name} {gib(self.bytes)}" + (f" ({self.source})" if self.source else "")


@dataclasses.dataclass(frozen=True)
class Footprint:
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        """The sum, rounded up to a whole GiB (the request and limit)."""
        return math.ceil(sum(t.bytes for t in self.terms) / GiB) * GiB

    def describe(self) -> str:
        return " + ".join(t.describe() for t in self.terms) + f" = {gib(self.total)}"


def gib(value: float) -> str:
    """A byte count as the shortest exact binary quantity (whole Gi, else Mi)."""
    if value % GiB == 0:
        return f"{int(value // GiB)}Gi"
    return f"{math.ceil(value / 2**20)}Mi"


def weights_term(session: InferenceSession, gpu: bool) -> Term:
    model = session.model
    if model.checkpoint_size:
        size, source = quantity_bytes(model.checkpoint_size), "model.checkpointSize"
    elif model.cache.enabled and model.cache.size:
        size, source = quantity_bytes(model.cache.size), "model.cache.size, an upper bound: set model.checkpointSize"
    else:
        size, source = UNKNOWN_WEIGHTS[gpu], "allowance for an unknown checkpoint: set model.checkpointSize"
    if not gpu:
        return Term("weights", int(2 * size), "checkpoint and parameters, " + source)
    return Term("weights", int(size), source)


def footprint(session: InferenceSession, tier: CacheTier | None, shm_bytes: int) -> Footprint:
    gpu, processes = session.resources.gpus > 0, max(1, session.resources.gpus)
    per = f"{processes} processes, one per GPU" if processes > 1 else ""
    terms = [Term("runtime", RUNTIME[gpu] * processes, per), weights_term(session, gpu)]
    if not gpu:
        terms.append(Term("state pool", CPU_STATE_POOL))
    if tier is not None and tier.host_size_gb > 0:
        terms.append(Term("host tier", int(tier.host_size_gb * GiB), f"CacheTier {tier.name} host.sizeGb"))
    elif tier is not None and tier.storage.enabled:
        terms.append(Term("storage staging", STORAGE_STAGING))
    if gpu:
        terms.append(Term("pinned buffers", PINNED_BUFFERS * processes, per))
    terms.append(Term("/dev/shm", shm_bytes))
    return Footprint(tuple(terms))


def container_resources(session: InferenceSession, need: Footprint) -> dict[str, Any]:
    """requests and limits of the server container: the spec's, the footprint for memory, GPUs."""
    gpu = session.resources.gpus > 0
    requests = {k: _quantity(v) for k, v in session.resources.requests.items()}
    limits = {k: _quantity(v) for k, v in session.resources.limits.items()}
    # A limit alone makes the API server default the request to it; adding one could exceed it.
    if "cpu" not in requests and "cpu" not in limits:
        requests["cpu"] = str(DEFAULT_CPU[gpu] + max(0, session.resources.gpus - 1))
    if "memory" not in requests and "memory" not in limits:
        requests["memory"] = gib(need.total)
    if "memory" not in limits:
        limits["memory"] = requests["memory"]
    if gpu:
        # Extended resources must be requested and limited with the same value.
        requests[session.resources.gpu_resource_name] = str(session.resources.gpus)
        limits[session.resources.gpu_resource_name] = str(session.resources.gpus)
    return {"requests": dict(sorted(requests.items())), "limits": dict(sorted(limits.items()))}


def _quantity(value: Any) -> Any:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

"""A live stack on loopback for the chart's monitoring tests: the real server under load, the real
operator (run with the args the chart renders) against kmock's Kubernetes emulator, and a real
Prometheus (Debian's package) scraping both and evaluating the chart's alert rules.

Scrape labels mimic what prometheus-operator attaches to server pods selected by the chart's
PodMonitor or the operator's ServiceMonitors (`namespace`, `pod`, and the session label as
`mambaserve_io_session`), and the operator's ServiceMonitor (`job` = the operator Service name).
Everything runs in a temporary directory and is stopped by ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import yaml

from mambaserve.operator import names

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
MODEL = ROOT / "models" / "mamba2-tiny-pystdlib"

SERVER_LABELS = {"namespace": "llm", "pod": "chat-7d9f8-x2x7k", "mambaserve_io_session": "chat"}
OPERATOR_NAMESPACE = "mambaserve-system"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def http_method(request: Any) -> str:
    """kmock's request method is an enum; RBAC maps the plain HTTP verb."""
    return str(getattr(request.method, "value", request.method)).upper()


def model_dir(tmp: pathlib.Path) -> pathlib.Path:
    """The bundled model, or a tiny random checkpoint when it is not there."""
    if (MODEL / "config.json").exists():
        return MODEL
    from tests.server.tiny_models import make_checkpoint
    return make_checkpoint(tmp / "tiny-model")


class Emulator:
    """kmock's Kubernetes emulator on its own event loop in a thread, so that a subprocess (the
    operator) can talk to it while the test code stays synchronous. It can enforce RBAC (403 for
    what the rendered rules do not allow) and inject a transient API failure."""

    def __init__(self) -> None:
        from tests.operator.conftest import Cluster, VersionedEmulator, register_resources

        outer = self

        class Guarded(VersionedEmulator):
            # Checked here, not with kmock reactions: a reaction re-scans every earlier request
            # on each new one, which makes a long run quadratic. Authorization runs before kmock
            # parses the request, as a real API server's does (and kmock cannot parse every path
            # that RBAC refuses, e.g. a cluster-wide list of namespaces).
            async def __call__(self, raw_request: Any) -> Any:
                import aiohttp.web
                refused = outer._authorize(raw_request.method, raw_request.path, dict(raw_request.query),
                                           raw_request.headers.get("User-Agent", ""))
                if refused is None and outer._creating_apply(raw_request):
                    # A server-side apply that creates is authorized as a create too (as the API server does).
                    collection = raw_request.path.rsplit("/", 1)[0]
                    outer.implied.append({"method": "POST", "agent": raw_request.headers.get("User-Agent", ""),
                                          "params": {}, "path": collection})
                    refused = outer._authorize("POST", collection, {}, raw_request.headers.get("User-Agent", ""))
                if refused is None and raw_request.method in ("POST", "PATCH", "PUT") and raw_request.can_read_body:
                    refused = outer._authorize_owners(raw_request.path, await raw_request.read(),
                                                      raw_request.headers.get("User-Agent", ""))
                if refused is not None:
                    return aiohttp.web.json_response(status=403, data={
                        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                        "code": 403, "message": refused})
                if raw_request.method == "GET" and raw_request.path.rstrip("/") == "/api/v1/namespaces":
                    return await outer._namespaces(raw_request)
                return await super().__call__(raw_request)

            async def _handle(self, request: Any) -> Any:
                import kmock
                data = request.data if isinstance(request.data, dict) else {}
                collection = request.url.path if http_method(request) == "POST" else request.url.path.rsplit("/", 1)[0]
                if http_method(request) in ("POST", "PATCH") and outer._absent(request.url.path) and \
                        (collection, (data.get("metadata") or {}).get("name")) in outer.failing:
                    raise kmock.KubernetesError(status=500, reason="InternalError",
                                                message="etcdserver: request timed out")
                return await super()._handle(request)

        self.authorizer: Any = None
        self.denied: list[str] = []
        self.failing: set[tuple[str, str]] = set()
        self.answered: list[dict[str, Any]] = []  # requests answered here rather than by kmock
        self.implied: list[dict[str, Any]] = []  # accesses admission checked on the operator's behalf
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.thread.start()

        async def start() -> None:
            import kmock
            self.kmock = Guarded()
            await self.kmock.__aenter__()
            self.server = kmock.Server(self.kmock)
            await self.server.__aenter__()
            register_resources(self.kmock)
            self.cluster = Cluster(self.kmock)

        self.call(start())
        self.url = str(self.server.url).rstrip("/")

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _authorize(self, method: str, path: str, params: dict[str, str], agent: str) -> str | None:
        """Why the request is forbidden, or None. This test's own client (kmock's) plays kubectl."""
        from tests.charts.rbac import access_of

        if self.authorizer is None or agent.startswith("kmock/"):
            return None
        access = access_of(method.upper(), path, params)
        if access is None or self.authorizer.allows(access):
            return None
        self.denied.append(str(access))
        return f"{access} is forbidden by the chart's RBAC"

    def _absent(self, path: str) -> bool:
        """No object at this path (a POST's collection path names none)."""
        from tests.charts.rbac import access_of

        access = access_of("GET", path, {})
        if access is None or access.name is None:
            return True
        return not any(r.plural == access.resource.split("/")[0] and ns == access.namespace and n == access.name
                       and not obj.deleted for (r, ns, n), obj in self.kmock.objects.items())

    def _creating_apply(self, raw_request: Any) -> bool:
        return raw_request.method == "PATCH" and "apply-patch" in raw_request.headers.get("Content-Type", "") \
            and self.authorizer is not None and self._absent(raw_request.path)

    def _authorize_owners(self, path: str, raw: bytes, agent: str) -> str | None:
        """OwnerReferencesPermissionEnforcement (on in OpenShift): blockOwnerDeletion needs update
        on the owner's finalizers. Checked accesses are recorded as requests the operator made."""
        import json

        from tests.charts.rbac import access_of, owner_reference_accesses

        if self.authorizer is None or agent.startswith("kmock/"):
            return None
        target = access_of("POST", path, {})
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            return None
        for access in owner_reference_accesses(body, target.namespace if target else None):
            self.implied.append({"method": "PUT", "agent": agent, "params": {},
                                 "path": f"/apis/{access.group}/v1alpha1/namespaces/{access.namespace}/"
                                         f"{access.resource.split('/')[0]}/{access.name}/finalizers"})
            if not self.authorizer.allows(access):
                self.denied.append(str(access))
                return (f"cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set "
                        f"finalizers on: {access} is forbidden by the chart's RBAC")
        return None

    NAMESPACES = ("default", "llm", "other", "mambaserve-system")

    async def _namespaces(self, raw_request: Any) -> Any:
        """The cluster-wide namespace list and watch Kopf makes in namespaced mode. kmock 0.8 cannot
        parse this path (it takes "namespaces" for the start of a namespaced path), so answer it here:
        a fixed list, and a watch that stays open without events."""
        import aiohttp.web
        self.answered.append({"method": "GET", "path": raw_request.path, "params": dict(raw_request.query),
                              "agent": raw_request.headers.get("User-Agent", "")})
        if raw_request.query.get("watch") in ("true", "1"):
            response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await response.prepare(raw_request)
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await asyncio.sleep(float(raw_request.query.get("timeoutSeconds", 300)))
            return response
        return aiohttp.web.json_response({
            "apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": "1"},
            "items": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n, "resourceVersion": "1"}}
                      for n in self.NAMESPACES]})

    def fail_creates(self, path: str, name: str) -> None:
        """Answer 500 to creating the object `name` at `path` (a transient error: the operator
        counts a failed reconciliation and Kopf retries)."""
        self.failing.add((path, name))

    def enforce(self, authorizer: Any) -> None:
        """Answer 403 to every request of the operator (anything but this test's own client) that
        the rendered RBAC does not allow, as a real API server with those bindings would."""
        self.authorizer = authorizer

    def get(self, kind: str, name: str, namespace: str = "llm") -> dict[str, Any] | None:
        async def read() -> dict[str, Any] | None:
            return self.cluster.get(kind, name, namespace)
        return self.call(read())

    def eventually(self, check: Any, what: str, timeout: float = 120.0) -> None:
        # generous: on a 2-core CI machine the operator shares the CPU with a loaded server and
        # Prometheus, and a deletion can wait out one of Kopf's retry backoffs (seen: > 30 s)
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the operator did not {what} within {timeout}s")
            time.sleep(0.2)

    def requests(self) -> list[dict[str, Any]]:
        """Every request the emulator received: method, path, query and user agent."""
        async def collect() -> list[dict[str, Any]]:
            return [{"method": http_method(r), "path": r.url.path, "params": dict(r.params),
                     "agent": (r.headers or {}).get("User-Agent", "")} for r in self.kmock]
        return self.call(collect()) + list(self.answered) + list(self.implied)

    def close(self) -> None:
        async def stop() -> None:
            await self.server.__aexit__(None, None, None)
            await self.kmock.__aexit__(None, None, None)
        with contextlib.suppress(Exception):
            self.call(stop(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def operator_command(deployment: dict[str, Any], api_server: str) -> list[str]:
    """The operator's command line exactly as the chart's Deployment runs it, plus the emulator URL."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [str(BIN / container["command"][0]), *container["args"], f"--api-server={api_server}"]


class Operator:
    def __init__(self, deployment: dict[str, Any], api_server: str, log: pathlib.Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "MAMBASERVE_"))}
        # The downward API's values, as the kubelet would give them to the pod.
        fields = {"metadata.name": "mambaserve-operator-7c9d-x2x7k", "metadata.namespace": OPERATOR_NAMESPACE}
        for var in deployment["spec"]["template"]["spec"]["containers"][0].get("env", []):
            env[var["name"]] = var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        self.log = log
        self.proc = subprocess.Popen(operator_command(deployment, api_server), env=env,
                                     stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        _stop(self.proc)


class Load:
    """Traffic that makes every server metric move: repeated and fresh prompts (hits, misses,
    evictions), streaming-session turns (session-tier hits), closes by client and by timeout,
    a snapshot and restore, and malformed requests (rejections)."""

    PREFIXES = ["def fibonacci(n):\n    ", "import os\nimport sys\n\ndef main():\n    ",
                "class Stack:\n    def __init__(self):\n        ", "for i in range(10):\n    print("]

    def __init__(self, url: str, model: str, seconds: float, workers: int = 3) -> None:
        self.url, self.model, self.seconds, self.workers = url, model, seconds, workers
        self.errors: list[str] = []
        self.counts = {"completions": 0, "turns": 0, "rejected": 0, "restores": 0}
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _completions(self, c: httpx.Client, seed: int, stop: float) -> None:
        rng = random.Random(seed)
        n = 0
        while time.monotonic() < stop:
            n += 1
            prefix = rng.choice(self.PREFIXES)
            # Mostly repeated prompts (cache hits), some fresh ones (misses that evict).
            prompt = prefix if rng.random() < 0.6 else prefix + f"x_{rng.randrange(10**6)} = {rng.random()}\n"
            r = c.post("/v1/completions", json={"model": self.model, "prompt": prompt, "temperature": 0,
                                                "max_tokens": rng.choice([4, 8, 16])})
            self._check(r)
            self._count("completions")
            if n % 20 == 1:  # from the first completion on, however slow the machine: the rejection panels get data
                self._check(c.post("/v1/completions", json={"model": self.model, "prompt": 42}), ok=False)
                self._count("rejected")

    def _sessions(self, c: httpx.Client, stop: float) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            sid = c.post("/open_session", json={"streaming": True, "session_id": f"s{n}"}).json()
            for turn in range(3):
                body = {"text": f" turn {turn} of {n}: ", "session_params": {"id": sid},
                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
                self._check(c.post("/generate", json=body))
                self._count("turns")
            if n % 3 == 1:  # migrate: snapshot, restore under a new id, close the copy
                snap = c.post(f"/sessions/{sid}/snapshot", json={"name": f"{sid}.safetensors"})
                self._check(snap)
                restored = c.post("/sessions/restore", json={"name": f"{sid}.safetensors",
                                                              "session_id": f"{sid}-moved"})
                self._check(restored)
                self._count("restores")
                c.post("/close_session", json={"session_id": f"{sid}-moved"})
            if n % 4 == 0:
                c.post("/open_session", json={"streaming": True, "session_id": f"idle{n}", "timeout": 0.5})
            c.post("/close_session", json={"session_id": sid})
            time.sleep(0.2)

    def _check(self, r: httpx.Response, ok: bool = True) -> None:
        if (r.status_code == 200) != ok:
            with self._lock:
                self.errors.append(f"{r.request.url.path}: {r.status_code} {r.text[:200]}")

    def _storage_round_trip(self, c: httpx.Client) -> None:
        """A prompt computed, the GPU and host tiers flushed, the same prompt again: its state comes back
        from the storage tier however few requests a slow machine gets through (the storage panels' reads)."""
        body = {"model": self.model, "prompt": self.PREFIXES[0] + "storage = 1\n", "max_tokens": 1, "temperature": 0}
        self._check(c.post("/v1/completions", json=body))
        deadline = time.monotonic() + 30
        while c.post("/flush_cache").status_code != 200:  # busy while the state is still being written
            if time.monotonic() > deadline:
                self.errors.append("/flush_cache: busy for 30 s")
                break
            time.sleep(0.1)
        self._check(c.post("/v1/completions", json=body))

    def run(self) -> None:
        stop = time.monotonic() + self.seconds
        with httpx.Client(base_url=self.url, timeout=60.0) as c:
            self._storage_round_trip(c)
            threads = [threading.Thread(target=self._completions, args=(c, i, stop)) for i in range(self.workers)]
            threads.append(threading.Thread(target=self._sessions, args=(c, stop)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()


class Prometheus:
    def __init__(self, workdir: pathlib.Path, scrape: dict[str, tuple[str, dict[str, str]]],
                 rule_groups: list[dict[str, Any]]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: run `make tools` (Debian package `prometheus`)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target], "labels": labels}]}
                               for job, (target, labels) in scrape.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            cwd=workdir, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        wait_http(f"{self.url}/-/ready", 30, self.proc)

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def stop(self) -> None:
        _stop(self.proc)


def operator_objects() -> list[dict[str, Any]]:
    """InferenceSessions and CacheTiers that exercise every kind the operator manages (Deployment
    and StatefulSet workloads, HPA and KEDA, router RBAC, ServiceMonitors, a shared claim), plus
    one session whose ConfigMap the API server refuses (the fault is installed by the stack)."""
    from tests.operator.conftest import sample

    chat = sample("inferencesession-autoscaled")  # HPA, router (SA, Role, RoleBinding), shared tier
    chat["spec"]["model"].pop("tokenSecretRef", None)
    chat["spec"]["model"]["cache"] = {"enabled": True, "size": "20Gi"}  # a model claim and its download Job
    faulty = sample("inferencesession-minimal")
    faulty["metadata"]["name"] = "faulty"
    # agents: KEDA and a per-pod storage tier, so a StatefulSet.
    return [sample("cachetier-shared"), sample("cachetier-per-pod"), chat,
            sample("inferencesession-keda"), faulty]


class OperatorScenario:
    """Drives the operator through create, update and delete of every child kind."""

    def __init__(self, emulator: Emulator, server_port: int) -> None:
        self.emulator = emulator
        self.server_port = server_port
        self.error: BaseException | None = None

    def create(self) -> None:
        em = self.emulator
        for obj in operator_objects():
            em.call(em.cluster.create(obj))
        em.eventually(lambda: em.get("Deployment", "chat") and em.get("HorizontalPodAutoscaler", "chat")
                      and em.get("StatefulSet", "agents") and em.get("ScaledObject", "agents"),
                      "create the children of chat and agents")
        # A ready pod of chat's Deployment, the real server behind it: the operator scrapes it and keeps its
        # deletion cost from the server's open sessions.
        em.call(em.cluster.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "chat-5d8f7-x2x7k", "labels": names.session_labels("chat", "server"),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "chat-5d8f7",
                                              "uid": "uid-rs", "controller": True}]},
            "spec": {"containers": [{"name": "server", "ports": [{"name": "http",
                                                                  "containerPort": self.server_port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}))
        em.eventually(lambda: ((em.get("Pod", "chat-5d8f7-x2x7k") or {}).get("metadata", {}).get("annotations") or {})
                      .get("controller.kubernetes.io/pod-deletion-cost"), "keep a server pod's deletion cost")
        for name in ("chat", "agents"):  # spec changes: children are patched
            em.call(em.cluster.update_spec("InferenceSession", name, {"server": {"chunkedPrefillSize": 8192}}))
        em.eventually(lambda: "8192" in (em.get("StatefulSet", "agents") or {}).get("spec", {}).get(
            "template", {}).get("spec", {}).get("containers", [{}])[0].get("args", []), "patch agents' StatefulSet")

    def delete(self) -> None:
        em = self.emulator
        for name in ("chat", "agents"):
            em.call(em.cluster.delete("InferenceSession", name))
        em.eventually(lambda: not em.get("InferenceSession", "chat") and not em.get("InferenceSession", "agents")
                      and not em.get("Deployment", "chat"), "finalize deleted sessions")
        em.call(em.cluster.delete("CacheTier", "shared-tier"))
        em.eventually(lambda: not em.get("CacheTier", "shared-tier")
                      and not em.get("PersistentVolumeClaim", "shared-tier-storage"), "finalize a deleted tier")

    def run_create(self) -> None:
        try:
            self.create()
        except BaseException as e:  # reported by the test that reads the scenario
            self.error = e


class LiveStack:
    def __init__(self, workdir: pathlib.Path, operator_deployment: dict[str, Any], operator_job: str,
                 rule_groups: list[dict[str, Any]], authorizer: Any, load_seconds: float) -> None:
        self.workdir = workdir
        self.closers: list[Any] = []
        self.started = time.time()
        try:
            self._start(operator_deployment, operator_job, rule_groups, authorizer, load_seconds)
        except BaseException:
            self.close()
            raise

    def _start(self, deployment: dict[str, Any], operator_job: str, rule_groups: list[dict[str, Any]],
               authorizer: Any, load_seconds: float) -> None:
        # 1. The server (slowest to start: imports torch): a small slot pool so fresh prompts evict.
        self.server_port = free_port()
        model = model_dir(self.workdir)
        self.server_log = self.workdir / "server.log"
        self.server = subprocess.Popen(
            [str(BIN / "mambaserve"), "serve", "--model", str(model), "--port", str(self.server_port),
             "--mamba-cache-size", "12", "--max-running-requests", "2", "--context-length", "2048",
             # Two snapshots of the bundled model (0.8 MiB each) in the host tier: evicted states go there and
             # come back, and churn on to the storage tier (every request's state is written there too),
             # from where a hot prefix evicted from both is read back: every tier's metrics move.
             "--host-cache-size", "2MiB", "--storage-dir", str(self.workdir / "l3"),
             "--session-snapshot-dir", str(self.workdir / "snapshots"), "--log-level", "warning"],
            stdout=self.server_log.open("wb"), stderr=subprocess.STDOUT)
        self.closers.append(lambda: _stop(self.server))

        # 2. The emulator and the operator, with the args the chart renders.
        self.emulator = Emulator()
        self.closers.append(self.emulator.close)
        self.emulator.enforce(authorizer)
        self.emulator.fail_creates("/api/v1/namespaces/llm/configmaps", "faulty-config")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        self.operator_metrics_port, self.operator_health_port = ports["metrics"], ports["health"]
        self.operator = Operator(deployment, self.emulator.url, self.workdir / "operator.log")
        self.closers.append(self.operator.stop)

        # 3. Prometheus, scraping both with the labels prometheus-operator would attach.
        self.prometheus = Prometheus(self.workdir, {
            "llm/mambaserve-servers": (f"127.0.0.1:{self.server_port}", SERVER_LABELS),
            operator_job: (f"127.0.0.1:{self.operator_metrics_port}", {"namespace": OPERATOR_NAMESPACE}),
        }, rule_groups)
        self.closers.append(self.prometheus.stop)

        wait_http(f"http://127.0.0.1:{self.operator_health_port}/healthz", 60, self.operator.proc)
        wait_http(f"http://127.0.0.1:{self.server_port}/health", 120, self.server)

        # 4. Load on the server while the operator works through its scenario.
        self.scenario = OperatorScenario(self.emulator, self.server_port)
        scenario = threading.Thread(target=self.scenario.run_create, name="operator-scenario")
        scenario.start()
        self.server_url = f"http://127.0.0.1:{self.server_port}"
        model_name = httpx.get(f"{self.server_url}/v1/models", timeout=10).json()["data"][0]["id"]
        self.load_started = time.time()
        self.load = Load(self.server_url, model_name, load_seconds)
        self.load.run()
        self.traffic_ended = time.time()
        scenario.join(300)  # bounded by the scenario's own waits
        if self.scenario.error is None:
            try:
                self.scenario.delete()
            except BaseException as e:
                self.scenario.error = e
        time.sleep(2)  # a couple more scrapes after the load
        self.load_ended = time.time()

    def server_metrics_text(self) -> str:
        return httpx.get(f"{self.server_url}/metrics", timeout=10).text

    def operator_metrics_text(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.operator_metrics_port}/metrics", timeout=10).text

    def close(self) -> None:
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                closer()
        self.closers.clear()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def exported_names(text: str) -> set[str]:
    """Metric family names in a /metrics page, from its HELP/TYPE lines (present for labelled
    metrics even before a label value is used) and its samples, with the suffixes Prometheus
    stores (`_bucket`, `_sum`, `_count` of histograms, `_total` of counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        names.update(sample.name for sample in family.samples)
    for line in text.splitlines():
        m = re.match(r"# (?:HELP|TYPE) (\S+)", line)
        if m:
            names.add(m.group(1))
    return names



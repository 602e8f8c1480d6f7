"""Two operator processes (the chart's two replicas) against one emulated API server: only the holder of
the Lease reconciles, a standby takes over when the leader dies (SIGKILL: no release, so after the lease
duration), and a leader that stops cleanly (SIGTERM) hands the Lease over at once."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.charts.live_stack import Emulator, _stop, free_port, wait_http
from tests.operator.conftest import sample

BIN = pathlib.Path(sys.executable).parent
NAMESPACE = "mambaserve-system"
LEASE = {"lease-duration": "3", "renew-deadline": "2", "retry-period": "0.3"}


class Replica:
    def __init__(self, emulator: Emulator, name: str, log: pathlib.Path) -> None:
        self.name, self.health = name, free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "MAMBASERVE_"))}
        env.update({"POD_NAME": name, "POD_NAMESPACE": NAMESPACE, "PYTHONUNBUFFERED": "1"})
        self.log = log
        self.proc = subprocess.Popen(
            [str(BIN / "mambaserve-operator"), f"--api-server={emulator.url}", "--leader-election",
             *(f"--{k}={v}" for k, v in LEASE.items()), "--status-interval=0.5", "--metrics-port=0",
             f"--health-port={self.health}", "--namespace=llm"],
            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.health}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def requests(self, emulator: Emulator) -> list[dict[str, Any]]:
        return [r for r in emulator.requests() if r["agent"] == f"mambaserve-operator ({self.name})"]


def holder(emulator: Emulator) -> str | None:
    lease = emulator.get("Lease", "mambaserve-operator", NAMESPACE) or {}
    return (lease.get("spec") or {}).get("holderIdentity")


def server_args(emulator: Emulator) -> list[str]:
    return emulator.get("Deployment", "tiny")["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.fixture
def emulator() -> Any:
    em = Emulator()
    yield em
    em.close()


def test_a_standby_takes_over_when_the_leader_dies(emulator: Emulator, tmp_path: pathlib.Path) -> None:
    a = Replica(emulator, "op-a", tmp_path / "a.log")
    b = None
    try:
        emulator.eventually(lambda: holder(emulator) == "op-a", "elect op-a", timeout=30)
        b = Replica(emulator, "op-b", tmp_path / "b.log")
        wait_http(f"http://127.0.0.1:{b.health}/healthz", 30, b.proc)  # a standby is live too
        emulator.call(emulator.cluster.create(sample("inferencesession-minimal")))
        emulator.eventually(lambda: emulator.get("Deployment", "tiny"), "create the Deployment", timeout=30)
        time.sleep(1.0)
        # The standby only looked at the Lease: no watch, no write, no read of anything else.
        assert {(r["method"], r["path"]) for r in b.requests(emulator)} == {
            ("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/mambaserve-operator")}
        assert any(r["method"] == "PATCH" and "/deployments/tiny" in r["path"] for r in a.requests(emulator))

        # The leader dies without a word: the standby waits out the lease and takes over.
        killed = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        emulator.eventually(lambda: holder(emulator) == "op-b", "fail over to op-b", timeout=30)
        took = time.monotonic() - killed
        assert float(LEASE["lease-duration"]) - 0.5 < took < 15, took
        lease = emulator.get("Lease", "mambaserve-operator", NAMESPACE)["spec"]
        assert lease["leaseTransitions"] == 1
        emulator.call(emulator.cluster.update_spec("InferenceSession", "tiny", {"server": {"chunkedPrefillSize": 512}}))
        emulator.eventually(lambda: "512" in server_args(emulator), "reconcile under op-b", timeout=30)
        assert any(r["method"] == "PATCH" and "/deployments/tiny" in r["path"] for r in b.requests(emulator))

        # A clean stop releases the Lease: the new standby takes it within a few looks, not a lease duration.
        a = Replica(emulator, "op-a", tmp_path / "a2.log")
        wait_http(f"http://127.0.0.1:{a.health}/healthz", 30, a.proc)
        b.proc.send_signal(signal.SIGTERM)  # Kopf finishes its work first (a few seconds), then the release
        assert b.proc.wait(30) == 0, (tmp_path / "b.log").read_text()[-3000:]
        stopped = time.monotonic()
        emulator.eventually(lambda: holder(emulator) == "op-a", "hand over to op-a", timeout=30)
        assert time.monotonic() - stopped < float(LEASE["lease-duration"])
        emulator.call(emulator.cluster.update_spec("InferenceSession", "tiny", {"server": {"chunkedPrefillSize": 256}}))
        emulator.eventually(lambda: "256" in server_args(emulator), "reconcile under op-a again", timeout=30)
    finally:
        for replica in (a, b):
            if replica is not None:
                _stop(replica.proc)

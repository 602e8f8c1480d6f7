"""The processes of a tensor-parallel server (``--tensor-parallel-size N``): one per device, on one host.

Rank 0 is the server itself (HTTP, the scheduler, the leader); ``Ranks.start`` runs N-1 followers
(``python -m mambaserve.server.engine.tp_runner RANK``), each of which connects back over an authenticated
local socket (the command channel), receives the configuration, joins the process group (NCCL on GPUs,
gloo on CPUs, through a TCP store on loopback) and loads its shard. From then on the leader sends every
command that touches device state down the channel before it runs it itself (``tp_runner``), and the
followers run them in the same order: the collectives inside match across ranks.

A rank that dies takes the server down instead of leaving it hung on a collective: the leader's watchdog
polls its followers and, when one exits, logs which and why and ends the server (exit code 1; an
orchestrator restarts it); a follower exits when the leader does (its parent process changes, or the
channel ends). A rank alive but stuck fails its next collective after ``COLLECTIVE_TIMEOUT`` (the process group's
timeout), which ends that process, and so the server.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from mambaserve.server.config import ServerConfig
from mambaserve.server.model.parallel import TP

log = logging.getLogger(__name__)

# A collective that waits longer than this for another rank fails, and its process exits: longer than any
# step (a 2,048-token prefill of a 56B model is seconds) and than a rank's lead in compiling kernels at start.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
ADDRESS_ENV, KEY_ENV = "MAMBASERVE_TP_LEADER", "MAMBASERVE_TP_KEY"


def fatal(message: str) -> None:
    """End this process at once with ``message`` logged: its ranks can no longer run the model together (a
    rank gone, or out of step), and a server that waits on them would hang every request."""
    log.critical("%s", message)
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    os._exit(1)


def init_group(rank: int, size: int, device: torch.device, store_port: int) -> TP:
    """Join the process group: NCCL between GPUs, gloo between CPU processes; a gloo group beside NCCL's for
    host values (``TP.max_over_ranks``)."""
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    return _init(rank, size, device, store)


def _init(rank: int, size: int, device: torch.device, store) -> TP:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    cpu = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return TP(rank, size, dist.group.WORLD, cpu)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` (CUDA_VISIBLE_DEVICES chooses which GPUs those are), or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Ranks:
    """The leader's side: its followers (processes and command channels), the process group, the watchdog."""

    def __init__(self, size: int, procs: list[subprocess.Popen], conns: list[Connection]):
        self.size, self.procs, self.conns = size, procs, conns
        self.tp: TP | None = None
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, cfg: ServerConfig, context_length: int, size: int, device: torch.device) -> "Ranks":
        """Start followers 1..size-1 for ``cfg`` (the configuration every rank builds its pools from) and join
        the process group as rank 0 of ``size``."""
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        env = {**os.environ, ADDRESS_ENV: "%s:%d" % listener.address, KEY_ENV: key.hex()}
        procs = [subprocess.Popen([sys.executable, "-m", "mambaserve.server.engine.tp_runner", str(r)], env=env)
                 for r in range(1, size)]
        conns: list[Connection | None] = [None] * (size - 1)
        failed: list[str] = []
        threading.Thread(target=_watch_start, args=(procs, listener, failed), daemon=True).start()
        try:
            for _ in range(size - 1):
                conn = listener.accept()
                rank = conn.recv()
                conns[rank - 1] = conn
                conn.send((cfg, context_length, size, store.port))
        except (AuthenticationError, OSError, EOFError):
            pass  # woken by _watch_start: a follower ended while starting
        finally:
            listener.close()
        if failed or any(c is None for c in conns):
            for p in procs:
                p.kill()
            raise RuntimeError(f"tensor parallel: {failed[0] if failed else 'the followers did not connect'} (its "
                               "log above says why)")
        log.info("tensor parallel: %d ranks (followers' pids %s)", size, ", ".join(str(p.pid) for p in procs))
        ranks = cls(size, procs, conns)  # (its watchdog runs from here: a follower that ends while loading too)
        ranks.tp = _init(0, size, device, store)
        return ranks

    def send(self, command: tuple) -> None:
        """``command`` to every follower, in order with the ones before it."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as e:
                fatal(self.ended(wait=2.0) or f"tensor parallel: a follower's command channel failed ({e}): the "
                      "server stops")

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            if (gone := self.ended()) and not self._stopping.is_set():
                fatal(gone)

    def ended(self, wait: float = 0.0) -> str | None:
        """Which follower has ended, and how (None: all run); ``wait``: seconds to give one that is ending (a
        collective that failed because a rank's connection dropped runs before that rank's exit is seen)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, 1):
                code = p.poll()
                if code is not None:
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                    return (f"tensor-parallel rank {rank} (pid {p.pid}) ended with {how}: the model's shards on it "
                            "are gone, so the server stops (its log above says why it ended)")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        """Followers told to stop and waited for (killed after 10 s); the process group left."""
        self._stopping.set()
        self.send(("stop",))
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _watch_start(procs: list[subprocess.Popen], listener: Listener, failed: list[str]) -> None:
    """While the followers connect: one that exits first fails the start (the leader's accept is woken)."""
    while listener._listener is not None:  # (closed once every follower connected)
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                failed.append(f"rank {rank} exited with code {p.returncode} while starting")
                try:  # a connection with the wrong key: the accept raises instead of waiting
                    Client(listener.address, authkey=b"-").close()
                except Exception:
                    pass
                return
        threading.Event().wait(0.2)


def join(rank: int) -> tuple[Connection, ServerConfig, int, int, int]:
    """The follower's side of the start: die with the leader, connect to it, and receive (the configuration,
    the context length, the number of ranks, the process group's store port)."""
    _die_with_parent()
    host, port = os.environ[ADDRESS_ENV].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV]))
    conn.send(rank)
    cfg, context_length, size, store_port = conn.recv()
    return conn, cfg, context_length, size, store_port


def _die_with_parent() -> None:
    """This process ends when its parent (the leader) does, whatever it is doing then (a collective that the
    leader will never join). By polling: Linux's PR_SET_PDEATHSIG fires when the parent *thread* ends, and the
    leader starts its followers on the thread that loads the model, which ends once it has."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()

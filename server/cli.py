"""``mambaserve serve``: the command line, built into a ServerConfig once, here at the edge."""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import re
import socket
import sys
from pathlib import Path

from mambaserve.server.config import ServerConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown once: not for a help text that explains its own default, a flag without a value, or
    one whose default is "not set" (``(default: None)`` says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.required or action.nargs == 0:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A mistyped flag is one line that names it and where the flags are listed, not the usage block."""

    def error(self, message: str):
        # (unknown flags are reported by the top parser, whose --help lists only the commands)
        self.exit(2, f"{self.prog}: error: {message} (every flag: mambaserve serve --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mambaserve", description="Serve Mamba2 and hybrid Mamba2+attention language models over HTTP.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the HTTP server", formatter_class=_HelpFormatter,
                       usage="mambaserve serve --model MODEL [options]",
                       description="Start an OpenAI- and SGLang-compatible server for a Mamba2 or hybrid "
                                   "(Nemotron-H, Granite 4.0-H, Bamba) checkpoint.")
    s.add_argument("--model", required=True, help="checkpoint directory: Hugging Face Mamba2ForCausalLM (config.json, "
                   "*.safetensors, tokenizer) or mamba_ssm (config.json with d_model/n_layer/ssm_cfg, "
                   "pytorch_model.bin), or a hybrid's Hugging Face checkpoint (NemotronHForCausalLM, "
                   "GraniteMoeHybridForCausalLM, BambaForCausalLM)")
    s.add_argument("--served-model-name", help="model name in /v1/models and requests (default: directory name)")
    s.add_argument("--tokenizer", help="tokenizer directory or tokenizer.json file, if not the model's (mamba_ssm "
                   "checkpoints ship none)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to listen on all interfaces)")
    s.add_argument("--port", type=int, default=30000, help="HTTP port for the API, health checks and /metrics")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype; auto = bfloat16 on CUDA, float32 on CPU")
    s.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="SSM state pool dtype (bfloat16 doubles capacity at some accuracy cost)")
    s.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    s.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="devices one model is sharded over (one process each, on this host: cuda:0 .. cuda:N-1, or "
                        "CPU processes with gloo): its Mamba and attention heads, MLP and expert widths and vocabulary "
                        "split N ways, so a model larger than one GPU serves, and one model decodes faster on several")
    s.add_argument("--context-length", type=int, help="longest prompt + output accepted (default: from the model, "
                   "else 8192)")
    s.add_argument("--max-running-requests", type=int,
                   help="requests decoded together (default 256 on CUDA, 64 on CPU, at most 3/4 of the state slots)")
    s.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="prompt tokens prefilled per step; longer prompts are split across steps")
    s.add_argument("--mamba-cache-size", type=int,
                   help="state slots in the pool (default: what --mem-fraction-static leaves, at most 4 per running "
                        "request); refused at start, with the numbers, when it does not fit")
    s.add_argument("--mem-fraction-static", type=float, default=0.88,
                   help="share of the device's memory (RAM on CPU) for weights, state pool, CUDA graphs and "
                        "activations; the pool gets what the weights and a reserve leave of it")
    s.add_argument("--mamba-cache-strategy", default="no_buffer", choices=["no_buffer", "extra_buffer"],
                   help="where prefix-cache snapshots are taken (see docs/architecture.md)")
    s.add_argument("--mamba-track-interval", type=int, help="extra snapshots every N prompt tokens (extra_buffer)")
    s.add_argument("--page-size", type=int, help="tokens per KV page of hybrid models' attention layers (default 16); "
                   "for pure Mamba2, the radix cache's key alignment (default 1)")
    s.add_argument("--max-total-tokens", type=int,
                   help="hybrid models: tokens the KV pool holds, rounded up to pages (default: what "
                        "--mem-fraction-static leaves beside the state pool, at most a context per running request)")
    s.add_argument("--disable-radix-cache", action="store_true", help="turn prefix caching off")
    s.add_argument("--host-cache-size", type=byte_size, default=0,
                   help="host memory for the host cache tier, e.g. 32GiB: snapshots evicted from the device go "
                        "there and are loaded back on a hit; hybrid models: their Mamba snapshots, the KV pages "
                        "staying on the device (default 0: no host tier)")
    s.add_argument("--storage-dir",
                   help="directory of the storage cache tier (local disk, or a volume shared by pods): snapshots "
                        "are written there and found again by any server of the same model on it, also after a "
                        "restart (default: no storage tier; not for hybrid models)")
    s.add_argument("--storage-size", type=byte_size,
                   help="bytes the storage tier may hold, e.g. 50GiB; least recently used entries are deleted past "
                        "it (default: the free space of its filesystem less 5%% of its size, at least 1 GiB)")
    s.add_argument("--cache-write-policy", default="write_through",
                   choices=["write_through", "write_back", "write_through_selective"],
                   help="when snapshots go to the storage tier: as soon as a request ends (write_through), once "
                        "matched --cache-write-threshold times (write_through_selective), or when the host tier "
                        "fills and is about to drop them (write_back)")
    s.add_argument("--cache-write-threshold", type=int, default=2,
                   help="write_through_selective: hits of a snapshot before it is written to storage")
    s.add_argument("--cache-prefetch-policy", default="timeout", choices=["best_effort", "wait_complete", "timeout"],
                   help="a request whose prefix is on storage only: read it while the request waits its turn "
                        "(best_effort), hold its admission until the read has landed (wait_complete), or hold it "
                        "at most --cache-prefetch-timeout (timeout)")
    s.add_argument("--cache-prefetch-timeout", type=float, default=0.5,
                   help="seconds a request may wait for its prefix from storage (--cache-prefetch-policy timeout)")
    s.add_argument("--session-persist", action="store_true",
                   help="write every streaming session's state to the storage tier at each turn's end: a restarted "
                        "server, or another one on the same --storage-dir, continues it by its session id")
    s.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most")
    s.add_argument("--session-timeout", type=float, default=600.0, help="default idle timeout of a session (s)")
    s.add_argument("--max-session-timeout", type=float,
                   help="longest idle timeout a client may give its session (s); a longer one gets 400 (default: "
                        "3600, or --session-timeout if longer)")
    s.add_argument("--max-sessions-per-client", type=int,
                   help="open sessions one client may hold (its API key; without keys, its address), past it 429 "
                        "(default: half of --max-sessions with several API keys, else no limit beyond "
                        "--max-sessions: behind a router or proxy every caller has one address)")
    s.add_argument("--require-session-secret", action="store_true",
                   help="every session turn, close, snapshot and restore must send the session's secret (the "
                        "x-session-secret response header at its opening) as session_params.secret or the "
                        "x-session-secret header; 403 otherwise")
    s.add_argument("--session-slot-fraction", type=float, default=0.5,
                   help="share of the state pool idle streaming sessions may hold between turns; past it the least "
                        "recently active session's state becomes an ordinary cache snapshot (its next turn starts "
                        "from the cache), so sessions never starve other requests")
    s.add_argument("--session-snapshot-dir", default="mambaserve-sessions",
                   help="directory where /sessions/{id}/snapshot writes and /sessions/restore reads session files "
                        "(share it between servers to migrate sessions)")
    s.add_argument("--session-snapshot-max-bytes", type=byte_size, default="16GiB",
                   help="total size of the snapshot directory, e.g. 4GiB; a snapshot that would exceed it gets 507")
    s.add_argument("--session-snapshot-max-per-session", type=int, default=8,
                   help="snapshot files one session may keep (overwriting its own by name is always allowed)")
    s.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly (CUDA only; for debugging)")
    s.add_argument("--skip-server-warmup", action="store_true",
                   help="report ready without first running two short generations through the server (which "
                        "spare the first clients the first requests' one-time costs)")
    s.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each step's sampled tokens before preparing the next (for debugging and A/B timing)")
    s.add_argument("--burst-hold-ms", type=float, default=10.0,
                   help="an idle server holds its next step up to this long while requests whose headers have "
                        "arrived are still being read and checked, so that a client's burst runs as one prefill "
                        "step (0: launch at once); a lone request is not held for this")
    s.add_argument("--burst-quiet-ms", type=float, default=2.0,
                   help="within --burst-hold-ms, an idle server also holds its step this long after it last took a "
                        "request while fewer are waiting than the last burst brought (a client's burst can reach "
                        "the server a millisecond or two apart); 0: only while requests are being read")
    s.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="largest decode batch replayed from a CUDA graph; larger batches run eagerly")
    s.add_argument("--kernel-cache-dir",
                   help="directory of the compiled Triton kernels (TRITON_CACHE_DIR): on a volume that outlives the "
                        "pod, a restarted server loads the kernels it compiled before instead of compiling them "
                        "again at start (default: Triton's, ~/.triton/cache)")
    s.add_argument("--debug-cache-invariants", action="store_true",
                   help="check slot accounting after every step (slow; for tests and debugging)")
    s.add_argument("--request-timeout", type=float,
                   help="seconds a request may take from arrival to its last token; past it it ends with "
                        "finish_reason 'abort' and an error (default: no limit beyond max_tokens)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint except /health and "
                   "/metrics (also --api-key-file, or the MAMBASERVE_API_KEY environment variable)")
    s.add_argument("--api-key-file", help="read the API key from this file (a mounted Secret); several keys, one "
                   "per line, are several clients (session quotas and ownership go by key)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without their own seed")
    s.add_argument("--max-request-bytes", type=byte_size, default="8MiB",
                   help="largest request body accepted, e.g. 512KiB; larger ones get 413 before they are parsed")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting beyond the running ones; past it new requests get 503 with Retry-After")
    s.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="answers one request may ask for at most: its prompts (a list or a batch) x n")
    s.add_argument("--max-connections", type=int,
                   help="open HTTP connections at most; past it a request gets 503 with Retry-After and its "
                        "connection is closed (default: 3/4 of the open-file limit, at most 4096)")
    s.add_argument("--http-header-timeout", type=float, default=20.0,
                   help="seconds a request's line and headers may take to arrive, from its first byte (or from "
                        "the connection's opening); past it 408 and the connection is closed")
    s.add_argument("--http-body-timeout", type=float, default=60.0,
                   help="seconds a request's body may take to arrive after its headers; past it 408 and the "
                        "connection is closed")
    s.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM (or Ctrl-C) the server drains: /health answers 503, new requests get 503 with "
                        "Retry-After, the requests in flight (streams included) run to their end for at most this "
                        "many seconds, open sessions are written to storage (--session-persist), then it exits 0; a "
                        "second signal exits at once (default 25: within Kubernetes' default grace period, 30 s)")
    return p


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def byte_size(text: str) -> int:
    """``123``, ``512MiB``, ``32GiB``, ``1.5GB``: bytes (argparse type)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4096, 512MiB, 32GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "api_key_file")}
    keys = api_keys(args.api_key, args.api_key_file, os.environ.get("MAMBASERVE_API_KEY"))
    fields["api_key"], fields["api_keys"] = (keys[0] if keys else None), keys
    return ServerConfig(**fields)


def api_keys(flag: str | None, path: str | None, env: str | None) -> tuple[str, ...]:
    """The key from the flag, else the file's (one per line), else the environment; an empty key is an
    error, not "no key"."""
    try:
        text = flag if flag is not None else Path(path).read_text() if path else env
    except OSError as e:
        raise SystemExit(f"mambaserve: cannot read --api-key-file: {e.strerror}: {path}") from None
    if text is None:
        return ()
    keys = tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
    if not keys:
        raise SystemExit("mambaserve: the API key is empty (--api-key, --api-key-file or MAMBASERVE_API_KEY)")
    return keys


def serve(cfg: ServerConfig) -> None:
    """Bind the port first and load the model behind it (503 ``loading`` until ready); exit 2 if loading fails."""
    import uvicorn

    from mambaserve.server.api import connections
    from mambaserve.server.api.app import create_app
    from mambaserve.server.api.drain import Drain, DrainingServer
    from mambaserve.server.api.loading import LoadingApp
    from mambaserve.server.engine import gc_pauses
    from mambaserve.server.engine.engine import Engine
    from mambaserve.server.model.config import ModelLoadError

    def load():
        engine = Engine(cfg, arrivals=guard.arrivals)
        return engine, create_app(engine)

    shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    url = f"http://{shown}:{cfg.port}"
    failed: list[BaseException] = []

    def ready(engine) -> None:
        engine.metrics.watch_connections(guard)
        gc_pauses.freeze()  # (this process serves one engine until it exits; still 503 until this returns)
        gc_pauses.watch(engine.metrics.gc_pause)  # (after: the freeze's own collection is not serving's)
        print(f"\nmambaserve: serving {engine.model_name!r} at {url}\n  try:\n"
              f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{engine.model_name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48, "
              f"\"temperature\": 0}}'\n", flush=True)

    def failure(e: BaseException) -> None:
        failed.append(e)
        if isinstance(e, (ModelLoadError, ValueError)):
            logging.getLogger("mambaserve").error("%s", e)
        else:
            logging.getLogger("mambaserve").error("loading the model failed", exc_info=e)
        server.should_exit = True

    sock = listen(cfg.host, cfg.port)  # before anything loads: a taken port fails at once, in one line
    from mambaserve.server.api.warmup import warm_up

    app = LoadingApp(load, ready, failure,
                     None if cfg.skip_server_warmup else functools.partial(warm_up, api_key=cfg.api_key))
    descriptors = connections.raise_descriptor_limit()
    max_connections = cfg.max_connections or connections.default_max_connections(descriptors)
    logging.getLogger("mambaserve").info("open-file limit %d: at most %d connections", descriptors, max_connections)
    guard = connections.ConnectionGuard(max_connections, cfg.http_header_timeout, cfg.http_body_timeout)
    drain = Drain(cfg.drain_timeout)
    # Idle keep-alive connections live longer here than in the proxies and client pools in front (cloud
    # load balancers idle out at 60 s): the server is never the side that closes a connection a client
    # is about to reuse, which fails that request (uvicorn's default is 5 s, httpx's pools keep 5 s too).
    # A signal drains first (api/drain.py); uvicorn's own graceful wait is then a backstop of the same length.
    server = DrainingServer(uvicorn.Config(
        guard.middleware(drain.middleware(app)), host=cfg.host, port=cfg.port, http=guard.protocol(),
        loop="mambaserve.server.api.connections:GuardedEventLoop", log_level=cfg.log_level,
        timeout_graceful_shutdown=cfg.drain_timeout, timeout_keep_alive=75), drain,
        lambda: app.engine if app.app is not None else None)  # (a signal while loading stops at once)
    guard.open = lambda: len(server.server_state.connections)
    print(f"mambaserve: loading {cfg.model} (503 at {url}/health until ready)", flush=True)
    server.run(sockets=[sock])
    if failed:
        sys.exit(2)


def listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and an accepted socket inherits the listener's. Without it a stream's first chunk, written
    # right after its headers, could wait for the client's delayed ACK: 40 ms more TTFT (one request of a round in
    # eight, in benchmarks/multiturn.py on an H200)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"mambaserve: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def openmp_defaults(env=os.environ) -> None:
    """OpenMP worker threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a policy. Set
    before torch loads libgomp, which reads it once. Why: the model loads on a thread that then exits
    (api/loading.py), and with libgomp's default spin-then-sleep, parallel regions on the scheduler thread
    afterwards ran 12-25x slower on a busy 2-core machine (CPU serving: 6-9 against 190-300 tok/s in process);
    passive waiting removes it and costs nothing measurable there."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 2**10


def malloc_defaults(env=os.environ) -> None:
    """glibc's malloc with a fixed mmap threshold (128 KiB, where its dynamic one starts) unless the user set
    one (``MALLOC_MMAP_THRESHOLD_``). Why: glibc raises the threshold to the size of each large block freed, so
    after the first, every large buffer (a snapshot's state, a session record, a request's tensors; on several
    threads) comes from the heaps, whose freed space fragments instead of going back to the system: in a soak
    with the storage tier and --session-persist the heaps grew 198 -> 225 MB in 10 minutes, 54 -> 71 MB of it
    free (RSS +21 MB, still rising); with the threshold fixed, 127 -> 132 MB, 2-4 MB free (docs/reliability.md)."""
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> None:
    openmp_defaults()
    malloc_defaults()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            cfg = config_from_args(args)
        except ValueError as e:
            raise SystemExit(f"mambaserve: {e}") from None
        serve(cfg)


if __name__ == "__main__":
    main()

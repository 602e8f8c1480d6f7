"""Server configuration: built once at the edge (CLI) and passed down explicitly."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


DEFAULT_MAX_SESSION_TIMEOUT = 3600.0


@dataclass(frozen=True)
class ServerConfig:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    state_dtype: str = "float32"
    device: str = "auto"
    tensor_parallel_size: int = 1  # ranks (processes, one per device) the model is sharded over
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int = 2048
    mamba_cache_size: int | None = None
    mem_fraction_static: float = 0.88  # of the device's memory (RAM on CPU): weights + state pool + graphs + activations
    mamba_cache_strategy: str = "no_buffer"
    mamba_track_interval: int | None = None
    max_total_tokens: int | None = None  # hybrids: KV pool size in tokens (None: from --mem-fraction-static)
    page_size: int | None = None  # None: 16 for hybrid models (KV pages), 1 for pure Mamba2 (radix keys)
    disable_radix_cache: bool = False
    host_cache_size: int = 0  # bytes of host memory for the host cache tier (0: none)
    storage_dir: str | None = None  # the storage cache tier's directory (None: no storage tier)
    storage_size: int | None = None  # bytes the storage tier may hold (None: free disk less a margin)
    cache_write_policy: str = "write_through"
    cache_write_threshold: int = 2  # write_through_selective: hits before a snapshot is written
    cache_prefetch_policy: str = "timeout"  # best_effort admits before a read of a few ms lands: an idle server misses
    cache_prefetch_timeout: float = 0.5  # seconds, for the timeout prefetch policy
    session_persist: bool = False  # streaming sessions written to the storage tier at every turn's end
    max_sessions: int = 1024
    session_timeout: float = 600.0
    # a session's own timeout may not exceed it (None: an hour, or --session-timeout if longer; a float after init)
    max_session_timeout: float | None = None
    max_sessions_per_client: int | None = None  # None: half of max_sessions with several API keys, else no quota
    require_session_secret: bool = False
    session_slot_fraction: float = 0.5
    session_snapshot_dir: str = "mambaserve-sessions"
    session_snapshot_max_bytes: int = 16 * 2**30
    session_snapshot_max_per_session: int = 8
    debug_cache_invariants: bool = False
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    burst_hold_ms: float = 10.0  # an idle server's next step waits at most this for requests still arriving
    burst_quiet_ms: float = 2.0  # ... and this after the last submission, while fewer wait than the last burst brought
    skip_server_warmup: bool = False  # the CLI's warm-up requests before ready (api/warmup.py)
    cuda_graph_max_bs: int = 256
    kernel_cache_dir: str | None = None  # Triton's compile cache (TRITON_CACHE_DIR); None: Triton's default
    log_level: str = "info"
    seed: int = 0
    max_request_bytes: int = 8 * 2**20
    max_queued_requests: int = 1024
    max_prompts_per_request: int = 64
    request_timeout: float | None = None
    max_connections: int | None = None  # None: from the open-file limit (api/connections.py)
    http_header_timeout: float = 20.0
    http_body_timeout: float = 60.0
    drain_timeout: float = 25.0  # seconds a SIGTERM'd server lets in-flight requests finish (api/drain.py)
    api_key: str | None = field(default=None, repr=False)  # never logged
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # every key accepted (default: api_key alone)

    @property
    def sessions_per_client(self) -> int | None:
        """Open sessions one client may hold: the flag, else half the table when clients are told apart by
        their API keys (two or more), else no quota beyond the table (every caller would be one client)."""
        if self.max_sessions_per_client is not None:
            return self.max_sessions_per_client
        return max(1, self.max_sessions // 2) if len(self.api_keys) > 1 else None

    def __post_init__(self) -> None:
        """Values no model is needed to judge are refused here, before anything loads (ValueError, one line)."""
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.mamba_track_interval is not None and self.mamba_cache_strategy != "extra_buffer":
            raise ValueError("--mamba-track-interval needs --mamba-cache-strategy extra_buffer")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--state-dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and re.fullmatch(r"cuda:[0-9]+", self.device):
            raise ValueError(f"--device {self.device} names one GPU; with --tensor-parallel-size the ranks run on "
                             "cuda:0 .. cuda:N-1 (CUDA_VISIBLE_DEVICES chooses which GPUs those are): use --device "
                             "cuda or auto")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("context_length", "max_running_requests", "mamba_cache_size", "mamba_track_interval", "page_size",
                     "max_total_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.cache_write_policy not in ("write_through", "write_back", "write_through_selective"):
            raise ValueError("--cache-write-policy must be write_through, write_back or write_through_selective, "
                             f"got {self.cache_write_policy!r}")
        if self.cache_prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ValueError("--cache-prefetch-policy must be best_effort, wait_complete or timeout, "
                             f"got {self.cache_prefetch_policy!r}")
        if not (math.isfinite(self.cache_prefetch_timeout) and self.cache_prefetch_timeout > 0):
            raise ValueError(f"--cache-prefetch-timeout must be a positive number of seconds, got "
                             f"{self.cache_prefetch_timeout}")
        if self.cache_write_threshold < 1:
            raise ValueError(f"--cache-write-threshold must be >= 1, got {self.cache_write_threshold}")
        if self.storage_size is not None and self.storage_size < 1:
            raise ValueError(f"--storage-size must be a positive number of bytes, got {self.storage_size}")
        if self.storage_dir is not None and not self.storage_dir.strip():
            raise ValueError("--storage-dir is empty")
        if self.kernel_cache_dir is not None and not self.kernel_cache_dir.strip():
            raise ValueError("--kernel-cache-dir is empty")
        if self.session_persist and self.storage_dir is None:
            raise ValueError("--session-persist needs --storage-dir (sessions are persisted to the storage tier)")
        if self.storage_dir is not None and self.disable_radix_cache:
            raise ValueError("--storage-dir needs the prefix cache (drop --disable-radix-cache)")
        if self.host_cache_size < 0:
            raise ValueError(f"--host-cache-size must be >= 0 bytes, got {self.host_cache_size}")
        for name in ("chunked_prefill_size", "max_sessions", "cuda_graph_max_bs", "max_request_bytes",
                     "max_queued_requests", "max_prompts_per_request", "session_snapshot_max_bytes",
                     "session_snapshot_max_per_session"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.session_timeout) and self.session_timeout > 0):
            raise ValueError(f"--session-timeout must be a positive number of seconds, got {self.session_timeout}")
        if self.max_session_timeout is None:
            object.__setattr__(self, "max_session_timeout", max(DEFAULT_MAX_SESSION_TIMEOUT, self.session_timeout))
        if not (math.isfinite(self.max_session_timeout) and self.max_session_timeout >= self.session_timeout):
            raise ValueError(f"--max-session-timeout must be at least --session-timeout ({self.session_timeout:g} s), "
                             f"got {self.max_session_timeout}")
        if self.max_sessions_per_client is not None and self.max_sessions_per_client < 1:
            raise ValueError(f"--max-sessions-per-client must be >= 1, got {self.max_sessions_per_client}")
        if self.api_key and not self.api_keys:
            object.__setattr__(self, "api_keys", (self.api_key,))
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):
            raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {self.drain_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        for name in ("http_header_timeout", "http_body_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got "
                                 f"{getattr(self, name)}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout}")
        for name in ("burst_hold_ms", "burst_quiet_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a number of milliseconds >= 0, got "
                                 f"{getattr(self, name)}")
        if not 0 <= self.session_slot_fraction < 1:
            raise ValueError(f"--session-slot-fraction must be in [0, 1), got {self.session_slot_fraction}")


"""One L3 (storage tier) entry on disk: its name, its bytes and its compatibility key.

Pure functions over bytes and token ids; the storage worker does the I/O (``storage_worker``).

* **Name**: a hash chain over the token ids, one link per page of ``page_size`` tokens (the granularity
  the radix tree snapshots at), ``link_k = blake2b(link_{k-1} || page_k)``. The name depends on the
  tokens only, so a process restarted on the same directory, or another pod on the same volume,
  computes the same name for the same prefix; the entry's header holds the tokens themselves, so a
  hash collision can never hand out a wrong state.
* **Bytes**: ``MAGIC | u32 header length | header (JSON) | conv bytes | ssm bytes | sha256`` where the
  trailing SHA-256 covers everything before it. A truncated file misses bytes the header announces or
  its trailer; a flipped byte fails the checksum. Either way the entry is *corrupt*: skipped, counted,
  deleted, never loaded.
* **Compatibility key**: what must match for a state to mean the same thing here: the model's
  architecture and layer layout, a fingerprint of its weights, the weights and state dtypes, the
  scan's chunk size, the state's layout and this format's version. An entry with another key is
  *incompatible*: never loaded (it may belong to another model sharing the volume, so it is left in place).
  The layout is one device's (every head and group in the model's order) whatever the number of
  tensor-parallel ranks that wrote it (they gather a state on rank 0 before it reaches the host tier): entries
  written at one ``--tensor-parallel-size`` load at any other. Entries from before the layout was recorded have
  that layout (``same_compat``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Sequence

import torch

MAGIC = b"MSL3\x00\x01\r\n"
FORMAT_VERSION = 1
STATE_LAYOUT = "one-device"  # (as session files': sessions/snapshot.py)
CHECKSUM_BYTES = 32
_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 2**20  # a header announcing more is corrupt (a prompt of 8M tokens at most)


class EntryError(Exception):
    """An entry that must not be loaded; ``reason`` is ``corrupt``, ``invalid`` (well-formed, but not contents
    this server wrote: deleted as corrupt ones are), ``incompatible`` or ``missing``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def entry_name(tokens: Sequence[int], page_size: int = 1) -> str:
    """The hash chain's last link over ``tokens`` (a multiple of ``page_size``), in hex."""
    link = b"mambaserve-l3"
    for i in range(0, len(tokens), page_size):
        h = hashlib.blake2b(link, digest_size=20)
        h.update(struct.pack(f"<{min(page_size, len(tokens) - i)}q", *tokens[i:i + page_size]))
        link = h.digest()
    return link.hex()


def entry_path(root: Path, name: str) -> Path:
    """``root/entries/ab/<name>.l3``: 256 subdirectories keep each listing short on a shared volume."""
    return root / "entries" / name[:2] / f"{name}.l3"


def header_bytes(compat: dict, tokens: Sequence[int], page_size: int, shapes: dict[str, list[int]],
                 payload_bytes: int, **extra) -> bytes:
    """``extra``: more header fields (a session's KV file says which of its tokens it holds: ``kv_from``)."""
    header = {"format_version": FORMAT_VERSION, "compat": compat, "tokens": list(tokens), "page_size": page_size,
              "shapes": shapes, "payload_bytes": payload_bytes, **extra}
    body = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(body)) + body


def parse_header(prefix: bytes) -> tuple[dict, int]:
    """(header, offset of the payload) from the first bytes of a file; EntryError(corrupt) if they are not
    an entry's. ``prefix`` must hold the whole header (read ``header_span`` bytes first)."""
    if len(prefix) < len(MAGIC) + _LEN.size or not prefix.startswith(MAGIC):
        raise EntryError("corrupt", "not a mambaserve L3 entry (bad magic)")
    (n,) = _LEN.unpack_from(prefix, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > MAX_HEADER_BYTES or len(prefix) < start + n:
        raise EntryError("corrupt", "truncated header")
    try:
        header = json.loads(prefix[start:start + n])
        if not isinstance(header, dict) or not isinstance(header.get("tokens"), list):
            raise ValueError("no tokens")
    except ValueError as e:
        raise EntryError("corrupt", f"unreadable header: {e}") from None
    return header, start + n


def header_span(first: bytes) -> int:
    """Bytes to read for the whole header, given its first 12 (0 if they are not an entry's)."""
    if len(first) < len(MAGIC) + _LEN.size or not first.startswith(MAGIC):
        return 0
    return len(MAGIC) + _LEN.size + min(_LEN.unpack_from(first, len(MAGIC))[0], MAX_HEADER_BYTES + 1)


def same_compat(stored: object, compat: dict) -> bool:
    """Whether a stored key is ``compat`` (a key from before the state's layout was recorded has one device's)."""
    if isinstance(stored, dict) and "state_layout" not in stored:
        stored = {**stored, "state_layout": STATE_LAYOUT}
    return stored == compat


def check_compatible(header: dict, compat: dict) -> None:
    if header.get("format_version") != FORMAT_VERSION or not same_compat(header.get("compat"), compat):
        raise EntryError("incompatible", f"entry written by {header.get('compat')} (format "
                         f"{header.get('format_version')}), this server is {compat}")


def check_contents(header: dict, vocab: int, page_size: int, shapes: dict[str, list[int]],
                   whole_pages: bool = True) -> None:
    """What a compatible entry's header must hold before its tokens are indexed or its state loaded (a valid
    checksum proves only that the bytes are those written): its tokens a non-empty whole number of pages of
    ids in [0, vocab) (a session's files, ``whole_pages=False``: any number), this tier's page size and this
    model's state shapes. EntryError(invalid) otherwise."""
    tokens = header.get("tokens")
    if not tokens or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise EntryError("invalid", f"its tokens are not a non-empty list of ids in [0, {vocab})")
    if header.get("page_size") != page_size or (whole_pages and len(tokens) % page_size):
        raise EntryError("invalid", f"{len(tokens)} tokens in pages of {header.get('page_size')!r}, this tier's "
                                    f"are {page_size}")
    if header.get("shapes") != shapes:
        raise EntryError("invalid", f"state shapes {header.get('shapes')!r}, this model's are {shapes}")


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


# ---- the compatibility key ---------------------------------------------------------------------------

def weights_fingerprint(model_dir: str | os.PathLike, cache_file: Path | None = None) -> str:
    """SHA-256 over the checkpoint's config and weight files (names, sizes, bytes).

    Hashing reads every byte once (about 2-3 s per GB here); the result is remembered in ``cache_file``
    keyed by each file's path, size and mtime, so a restart on the same volume does not hash again."""
    d = Path(model_dir)
    files = sorted(p for p in d.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin", ".pt")
                                                           or p.name in ("config.json",)
                                                           or p.name.endswith(".index.json")))
    stamp = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    stamp_key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    known = {}
    if cache_file is not None:
        try:
            known = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known, dict) and isinstance(known.get(stamp_key), str):
            return known[stamp_key]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + str(p.stat().st_size).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(8 * 2**20):
                h.update(chunk)
    digest = h.hexdigest()[:32]
    if cache_file is not None and isinstance(known, dict):
        try:
            known[stamp_key] = digest
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(cache_file)
        except OSError:
            pass  # a read-only volume: hash again next time
    return digest


def compat_key(model_config: dict, weights: str, dtype: torch.dtype, state_dtype: torch.dtype, num_layers: int,
               conv_shape: Sequence[int], ssm_shape: Sequence[int], chunk_size: int, kv: Sequence | None = None) -> dict:
    """Everything a stored state depends on. ``conv_shape``/``ssm_shape``: one slot's, every layer; ``kv``
    (hybrids, whose entries hold their tokens' KV beside the state): attention layers, KV heads, head dim, dtype."""
    arch = {k: model_config.get(k) for k in ("model_type", "architectures", "hidden_size", "num_hidden_layers",
                                             "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
                                             "vocab_size", "expand", "layer_types", "hybrid_override_pattern")}
    return {"architecture": hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16],
            "weights": weights, "dtype": str(dtype).split(".")[-1], "state_dtype": str(state_dtype).split(".")[-1],
            "layers": num_layers, "conv": list(conv_shape), "ssm": list(ssm_shape), "chunk_size": chunk_size,
            "format": FORMAT_VERSION, "state_layout": STATE_LAYOUT, **({"kv": list(kv)} if kv else {})}

"""A session on disk: its tokens and live state, for restore in this or another server process.

Format (version 1): a safetensors file. Tensors ``conv [L, conv_dim, K-1]`` and ``ssm [L, H, P, N]``
(absent when the session had no live state); string metadata ``mambaserve`` holding a JSON header:
format version, compatibility key (model architecture hash, weights dtype, state dtype), session
fields, the token history, and a SHA-256 over the tensors' bytes and the tokens. A file whose
checksum or key does not match is refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mambaserve.server.sessions.table import SessionError

FORMAT_VERSION = 1


class SnapshotError(SessionError):
    """A snapshot file that cannot be written or read here (the status and code say why)."""


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def snapshot_path(directory: Path, name: str) -> Path:
    """``directory / name`` for a safe plain file name (letters, digits, ``._-``, at most 128, no leading dot)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.endswith(".tmp"):
        shown = name if isinstance(name, str) and len(name) <= 64 and name.isprintable() else "(not shown)"
        raise SnapshotError(400, f"invalid snapshot name {shown!r}: 1 to 128 letters, digits, '.', '_' or '-', "
                            "starting with a letter or digit", "invalid_request")
    return directory / name


def owner(path: Path) -> str | None:
    """The session id recorded in a snapshot file's header (None if unreadable)."""
    try:
        with safe_open(str(path), "pt") as f:
            return json.loads((f.metadata() or {})["mambaserve"])["session"]["id"]
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError, ValueError):
        return None


def usage(directory: Path) -> tuple[int, dict[str, int]]:
    """(bytes of every snapshot file in ``directory``, snapshot files per session id)."""
    total, per_session = 0, {}
    if directory.is_dir():
        for entry in os.scandir(directory):
            if entry.is_file() and not entry.name.endswith(".tmp"):
                total += entry.stat().st_size
                sid = owner(Path(entry.path))
                per_session[sid] = per_session.get(sid, 0) + 1
    return total, per_session


def compat_key(model_config: dict, dtype: torch.dtype, state_dtype: torch.dtype) -> dict:
    arch = {k: model_config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                                             "n_groups", "state_size", "conv_kernel", "vocab_size")}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]
    return {"architecture": digest, "dtype": str(dtype).split(".")[-1], "state_dtype": str(state_dtype).split(".")[-1]}


def _checksum(tensors: dict[str, torch.Tensor], tokens: list[int]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(tokens).encode())
    return h.hexdigest()


def estimate_bytes(tokens: list[int], state: dict[str, torch.Tensor] | None) -> int:
    """About the size ``write`` gives the file: the tensors' bytes plus the JSON header (tokens as text)."""
    return sum(t.numel() * t.element_size() for t in (state or {}).values()) + 8 * len(tokens) + 4096


def write(path: Path, key: dict, session: dict, tokens: list[int], state: dict[str, torch.Tensor] | None) -> int:
    tensors = {k: v.detach().cpu().contiguous() for k, v in (state or {}).items()}
    header = {"format_version": FORMAT_VERSION, "compat": key, "session": session, "tokens": tokens,
              "has_state": bool(tensors), "checksum": _checksum(tensors, tokens)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={"mambaserve": json.dumps(header)})
    tmp.replace(path)  # a crash never leaves a half-written snapshot under the real name
    return path.stat().st_size


def read(path: Path, key: dict) -> tuple[dict, list[int], dict[str, torch.Tensor] | None]:
    if not path.is_file():
        raise SnapshotError(404, f"no session snapshot named {path.name!r}", "snapshot_not_found")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        header = json.loads(meta["mambaserve"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise SnapshotError(400, f"{path.name} is not a mambaserve session snapshot (corrupt or truncated: "
                            f"{type(e).__name__})", "snapshot_corrupt") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(409, f"snapshot format {header.get('format_version')} is not supported "
                            f"(this server reads {FORMAT_VERSION})", "snapshot_incompatible")
    if header.get("compat") != key:
        raise SnapshotError(409, f"snapshot was taken with {header.get('compat')}, this server runs {key}",
                            "snapshot_incompatible")
    tokens = header["tokens"]
    if _checksum(tensors, tokens) != header.get("checksum"):
        raise SnapshotError(400, f"{path.name}: checksum mismatch (the file was modified or damaged)",
                            "snapshot_corrupt")
    return header["session"], tokens, (tensors if header.get("has_state") else None)

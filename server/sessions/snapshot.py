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
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mambaserve.server.sessions.table import SessionError

FORMAT_VERSION = 1


class SnapshotError(SessionError):
    """A snapshot file that cannot be written or read here (the status and code say why)."""


def snapshot_path(directory: Path, name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise SnapshotError(400, f"invalid snapshot name {name!r} (a plain file name)", "invalid_request")
    return directory / name


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
        raise SnapshotError(404, f"no session snapshot at {path}", "snapshot_not_found")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        header = json.loads(meta["mambaserve"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise SnapshotError(400, f"{path} is not a mambaserve session snapshot (corrupt or truncated): {e}",
                            "snapshot_corrupt") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(409, f"snapshot format {header.get('format_version')} is not supported "
                            f"(this server reads {FORMAT_VERSION})", "snapshot_incompatible")
    if header.get("compat") != key:
        raise SnapshotError(409, f"snapshot was taken with {header.get('compat')}, this server runs {key}",
                            "snapshot_incompatible")
    tokens = header["tokens"]
    if _checksum(tensors, tokens) != header.get("checksum"):
        raise SnapshotError(400, f"{path}: checksum mismatch (the file was modified or damaged)", "snapshot_corrupt")
    return header["session"], tokens, (tensors if header.get("has_state") else None)

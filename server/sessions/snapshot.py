"""A session on disk: its tokens and live state, for restore in this or another server process.

Format (version 1): a safetensors file. Tensors ``conv [L, conv_dim, K-1]`` and ``ssm [L, H, P, N]``
(absent when the session had no live state); string metadata ``mambaserve`` holding a JSON header:
format version, compatibility key (model architecture hash, weights dtype, state dtype, the state's layout),
session fields, the token history, and a SHA-256 over the tensors' bytes and the tokens. A file whose
checksum or key does not match is refused with the reason.

The state's layout (``STATE_LAYOUT``) is one device's: every head and group of the model, in its own order,
whatever the number of tensor-parallel ranks that held it (they gather it to write the file and cut their
parts out of it to restore one), so a file written at one ``--tensor-parallel-size`` restores at any other.
A file that says another layout is refused: its tensors could not be cut into this server's ranks' parts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mambaserve.server.sessions.table import MAX_TIMEOUT_S, SessionError

FORMAT_VERSION = 1
STATE_LAYOUT = "one-device"  # (files written before the layout was recorded have it: compat_of)


class SnapshotError(SessionError):
    """A snapshot file that cannot be written or read here (the status and code say why; ``reason``, for a file
    refused on reading: corrupt, incompatible, tokens, too_long, empty, fields or state)."""

    def __init__(self, status: int, message: str, code: str, reason: str = ""):
        super().__init__(status, message, code)
        self.reason = reason


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def snapshot_path(directory: Path, name: str) -> Path:
    """``directory / name`` for a safe plain file name (letters, digits, ``._-``, at most 128, no leading dot)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.endswith(".tmp"):
        shown = name if isinstance(name, str) and len(name) <= 64 and name.isprintable() else "(not shown)"
        raise SnapshotError(400, f"invalid snapshot name {shown!r}: 1 to 128 letters, digits, '.', '_' or '-', "
                            "starting with a letter or digit", "invalid_request")
    return directory / name


def owner_of(session: dict) -> str:
    """Who owns a session's files: the hash of its secret (a session id reopened after a close has another),
    for files of an older version its id."""
    return session.get("owner") or f"id:{session['id']}"


def owner(path: Path) -> str | None:
    """The owner (``owner_of``) recorded in a snapshot file's header (None if unreadable)."""
    try:
        with safe_open(str(path), "pt") as f:
            return owner_of(json.loads((f.metadata() or {})["mambaserve"])["session"])
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError, ValueError):
        return None


def usage(directory: Path) -> tuple[int, dict[str, int]]:
    """(bytes of every snapshot file in ``directory``, snapshot files per owner)."""
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
    return {"architecture": digest, "dtype": str(dtype).split(".")[-1], "state_dtype": str(state_dtype).split(".")[-1],
            "state_layout": STATE_LAYOUT}


def compat_of(header: dict) -> object:
    """A file's compatibility key, with the layout of files written before it was recorded (one device's)."""
    key = header.get("compat")
    return {**key, "state_layout": key.get("state_layout", STATE_LAYOUT)} if isinstance(key, dict) else key


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
                            f"{type(e).__name__})", "snapshot_corrupt", "corrupt") from None
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        version = header.get("format_version") if isinstance(header, dict) else None
        raise SnapshotError(409, f"snapshot format {version} is not supported (this server reads {FORMAT_VERSION})",
                            "snapshot_incompatible", "incompatible")
    compat = compat_of(header)
    if isinstance(compat, dict) and compat["state_layout"] != key["state_layout"]:
        raise SnapshotError(409, f"snapshot state is laid out as {compat['state_layout']!r}, which cannot be cut into "
                            f"this server's ranks' parts: it reads {key['state_layout']!r} (every head and group in "
                            "one device's order, at any --tensor-parallel-size)", "snapshot_incompatible",
                            "incompatible")
    if compat != key:
        raise SnapshotError(409, f"snapshot was taken with {header.get('compat')}, this server runs {key}",
                            "snapshot_incompatible", "incompatible")
    tokens = header.get("tokens")
    if _checksum(tensors, tokens) != header.get("checksum"):
        raise SnapshotError(400, f"{path.name}: checksum mismatch (the file was modified or damaged)",
                            "snapshot_corrupt", "corrupt")
    return header.get("session"), tokens, (tensors if header.get("has_state") else None)


# ---- what a session read back must hold ---------------------------------------------------------------
# A checksum proves that the bytes are those written, not that this server wrote them: a file crafted with a
# valid checksum, or written by a bug, is refused here with a reason instead of restoring a session whose
# tokens crash a step or whose every turn fails.

def check_session(fields: object, tokens: object, vocab: int, context_length: int) -> None:
    """A saved session's fields (id, streaming, timeout, capacity) and token history, as a turn will use them:
    tokens are ints in [0, vocab), the history leaves room for a turn, the capacity holds the history.
    Raises SnapshotError (400 ``snapshot_invalid``) naming what is wrong."""
    def refuse(reason: str, what: str):
        raise SnapshotError(400, f"the saved session is not usable here: {what}", "snapshot_invalid", reason)

    if not isinstance(fields, dict):
        refuse("fields", "no session fields")
    sid = fields.get("id")
    if not isinstance(sid, str) or not 1 <= len(sid) <= 128:
        refuse("fields", "its id is not a string of 1 to 128 characters")
    if not isinstance(fields.get("streaming"), bool):
        refuse("fields", "streaming is not true or false")
    timeout = fields.get("timeout")
    if timeout is not None and not (_number(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        refuse("fields", f"timeout {timeout!r} is not in (0, {MAX_TIMEOUT_S}] seconds")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        refuse("tokens", f"its history is not a list of token ids in [0, {vocab})")
    if len(tokens) + 2 > context_length:  # (a turn adds one token at least and answers one)
        refuse("too_long", f"its history of {len(tokens)} tokens leaves no room for a turn in the context of "
                           f"{context_length}")
    capacity = fields.get("capacity")
    if capacity is not None and (type(capacity) is not int or capacity < 0 or 0 < capacity <= len(tokens)):
        refuse("fields", f"capacity {capacity!r} does not hold its history of {len(tokens)} tokens and a turn")


def check_snapshot(fields: dict, tokens: list[int], state: dict[str, torch.Tensor] | None, vocab: int,
                   context_length: int, shapes: dict[str, tuple[int, ...]] | None) -> None:
    """A snapshot file's contents: ``check_session``, its ``in_state`` within its history, and its state (when it
    has one and ``shapes`` are given: this model's, one slot's) of those shapes and finite."""
    check_session(fields, tokens, vocab, context_length)
    in_state = fields.get("in_state", 0)
    if type(in_state) is not int or not 0 <= in_state <= len(tokens):
        raise SnapshotError(400, f"the saved session is not usable here: its state covers {in_state!r} tokens of a "
                                 f"history of {len(tokens)}", "snapshot_invalid", "fields")
    if state is None or shapes is None:
        return
    if set(state) != set(shapes) or any(tuple(state[k].shape) != tuple(v) for k, v in shapes.items()):
        raise SnapshotError(409, "snapshot state shapes do not match this model", "snapshot_incompatible",
                            "incompatible")
    if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in state.values()):
        raise SnapshotError(400, "the saved session is not usable here: its state is not finite",
                            "snapshot_invalid", "state")


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

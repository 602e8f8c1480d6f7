"""Reading checkpoints: ``model.safetensors`` or a sharded safetensors index, else PyTorch's
``pytorch_model.bin`` or its sharded index (mamba_ssm's layout), read with ``weights_only``.

Tensors are read when a parameter takes them (``Lazy``), and only the part a tensor-parallel rank holds
(``parallel.Slices``): safetensors files are memory-mapped and sliced, so a rank never holds the full
checkpoint, nor a full copy of a sharded tensor, in host memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.parallel import FIRST, Slices, shard_shape


class Lazy:
    """A checkpoint tensor not read yet: its ``shape``, and ``read(spec)``, the part ``spec`` names (all of it
    for None)."""

    shape: tuple[int, ...]

    def read(self, spec: Slices | None = None) -> torch.Tensor:
        raise NotImplementedError


def _pieces(n: int, spec: Slices):
    """(start, stop, zeros after) per range of ``spec``, clipped to a dimension of ``n``."""
    for a, b in spec.ranges:
        yield min(a, n), min(b, n), b - max(a, min(b, n))


class FileTensor(Lazy):
    """A tensor of an open safetensors file: slices are read from the mapped file."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self, spec: Slices | None = None) -> torch.Tensor:
        if spec is None:
            return self.handle.get_tensor(self.name)
        sl, parts = self.handle.get_slice(self.name), []
        lead = (slice(None),) * spec.dim
        for a, b, pad in _pieces(self.shape[spec.dim], spec):
            if b > a:
                parts.append(sl[lead + (slice(a, b),)])
            if pad:
                shape = list(self.shape)
                shape[spec.dim] = pad
                parts.append(torch.zeros(shape, dtype=parts[0].dtype if parts else torch.float32))
        return torch.cat(parts, dim=spec.dim)


class Loaded(Lazy):
    """A tensor already in memory (``.bin`` checkpoints, memory-mapped; tensors built at load)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def read(self, spec: Slices | None = None) -> torch.Tensor:
        if spec is None:
            return self.tensor
        parts = []
        for a, b, pad in _pieces(self.shape[spec.dim], spec):
            parts.append(self.tensor.narrow(spec.dim, a, b - a))
            if pad:
                shape = list(self.shape)
                shape[spec.dim] = pad
                parts.append(self.tensor.new_zeros(shape))
        return torch.cat(parts, dim=spec.dim)


class Stacked(Lazy):
    """Tensors of one shape stacked on a new first dimension (routed experts stored one per expert), each read
    by the same slices (``spec.dim`` counts the new dimension)."""

    def __init__(self, parts: list[Lazy]):
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)

    def read(self, spec: Slices | None = None) -> torch.Tensor:
        if spec is not None and spec.dim == 0:
            raise ValueError("stacked checkpoint tensors are sliced within each part, not across them")
        inner = None if spec is None else Slices(spec.dim - 1, spec.ranges)
        return torch.stack([p.read(inner) for p in self.parts])


def lazy(state: dict[str, torch.Tensor]) -> dict[str, Lazy]:
    """Tensors as ``Lazy`` ones (a state dict built in memory, for ``copy_into_parameters``)."""
    return {k: v if isinstance(v, Lazy) else Loaded(v) for k, v in state.items()}


def load_state_dict(model_dir: Path) -> dict[str, Lazy]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if not single.is_file() and not index.is_file() and (
            (model_dir / "pytorch_model.bin").is_file() or (model_dir / "pytorch_model.bin.index.json").is_file()):
        return _load_bin(model_dir)
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
    else:
        raise ModelLoadError(f"no weights in {model_dir}: expected model.safetensors, model.safetensors.index.json, "
                             "pytorch_model.bin or pytorch_model.bin.index.json")
    state: dict[str, Lazy] = {}
    for f in files:
        try:
            handle = safe_open(str(f), "pt")
            state.update({name: FileTensor(handle, name) for name in handle.keys()})
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    return state


def _load_bin(model_dir: Path) -> dict[str, Lazy]:
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid checkpoint index: {e}") from None
        files = [model_dir / n for n in names]
    else:
        files = [model_dir / "pytorch_model.bin"]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:  # weights_only: a checkpoint is data, never code
            part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # unpickling errors come in many types; the message says what is wrong
            raise ModelLoadError(f"cannot read {f}: {e}") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ModelLoadError(f"{f} is not a state dict of tensors")
        state.update({k: Loaded(v) for k, v in part.items()})
    return state


def shard_specs(module: torch.nn.Module) -> dict[str, Slices | str | None]:
    """Every parameter's part on this rank, by its full name: what the modules' ``tp_slices`` (parameter name
    relative to the module -> ``Slices``, ``FIRST`` or None: whole) say; parameters they do not name are
    whole (replicated)."""
    out = {}
    for prefix, m in module.named_modules():
        for name, spec in getattr(m, "tp_slices", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = spec
    return out


def copy_into_parameters(module: torch.nn.Module, state: dict[str, Lazy | torch.Tensor],
                         may_miss: frozenset[str] = frozenset(), rank: int = 0) -> None:
    """Copy a checkpoint's tensors into ``module``'s parameters (cast to their dtype), each read as this
    ``rank``'s part of it (``shard_specs``): every parameter but ``may_miss`` must be there, nothing else may
    be, and every shape must match, or ModelLoadError."""
    own = dict(module.named_parameters())  # a tied parameter is listed once, under its first name
    missing = sorted(set(own) - set(state) - may_miss)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match the config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    specs = shard_specs(module)
    with torch.no_grad():
        for name, tensor in lazy(state).items():
            p, spec = own[name], specs.get(name)
            expected = shard_shape(tensor.shape, spec)
            if tuple(p.shape) != expected:
                shown = f"{tuple(tensor.shape)} (this rank's part {expected})" if spec else f"{tuple(tensor.shape)}"
                raise ModelLoadError(f"{name}: checkpoint shape {shown} != expected {tuple(p.shape)}")
            if spec == FIRST and rank:
                p.zero_()
            else:
                p.copy_(tensor.read(spec if isinstance(spec, Slices) else None).to(p.dtype))

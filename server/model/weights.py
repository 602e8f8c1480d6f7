"""Reading checkpoints: ``model.safetensors`` or a sharded safetensors index, else PyTorch's
``pytorch_model.bin`` or its sharded index (mamba_ssm's layout), read with ``weights_only``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mambaserve.server.model.config import ModelLoadError


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
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
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    return state


def _load_bin(model_dir: Path) -> dict[str, torch.Tensor]:
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
        state.update(part)
    return state


def copy_into_parameters(module: torch.nn.Module, state: dict[str, torch.Tensor],
                         may_miss: frozenset[str] = frozenset()) -> None:
    """Copy a checkpoint's tensors into ``module``'s parameters (cast to their dtype): every parameter but
    ``may_miss`` must be there, nothing else may be, and every shape must match, or ModelLoadError."""
    own = dict(module.named_parameters())  # a tied parameter is listed once, under its first name
    missing = sorted(set(own) - set(state) - may_miss)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match the config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            p = own[name]
            if p.shape != tensor.shape:
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
            p.copy_(tensor.to(p.dtype))

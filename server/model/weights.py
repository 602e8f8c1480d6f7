"""Reading safetensors checkpoints: a single ``model.safetensors`` or a sharded index."""

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
        raise ModelLoadError(
            f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not loaded: convert them to safetensors)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    return state

"""From a checkpoint directory to a ready model on a device, with clear errors on the way."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mambaserve.kernels import KernelConfig
from mambaserve.server.model.config import ModelLoadError, read_config
from mambaserve.server.model.mamba2 import Mamba2ForCausalLM
from mambaserve.server.model.parallel import SINGLE, TP
from mambaserve.server.model.registry import resolve
from mambaserve.server.model.weights import load_state_dict

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available (use --device cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError("this GPU cannot run bfloat16 (compute capability < 8.0): use --dtype float16")
    try:  # the cheapest proof that the device runs this dtype's matmul
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as e:
        raise ModelLoadError(f"device {device} cannot run dtype {name}: {e}") from None
    return dtype


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               kernel_config: KernelConfig | None = None, tp: TP = SINGLE) -> tuple[Mamba2ForCausalLM, dict]:
    """The model ``config.json`` names (``registry.ARCHITECTURES``), weights loaded, on ``device``; at
    ``tp.size`` > 1 this rank's shard of it (``parallel``), read from the checkpoint alone."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    arch = resolve(cfg)
    dims = arch.read_dims(cfg)
    state = load_state_dict(model_dir)
    with torch.device("meta"):
        model = arch.model_class(dims, kernel_config, tp)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype: fp32 first would double the peak
    if dims.tie_word_embeddings:  # to_empty breaks the tie: restore it
        model.tie_weights()
    model.load_weights(state)
    # A, D, dt_bias are tiny and decide the recurrence's decay: keep them in fp32 (as mamba_ssm does).
    for mixer in model.mixers():
        for name in ("A_log", "D", "dt_bias"):
            p = getattr(mixer, name)
            p.data = p.data.float()
    model.eval()
    s = model.state_dims
    shard = f" (rank {tp.rank} of {tp.size}: its heads and rows)" if tp.size > 1 else ""
    log.info("loaded %s (%s): %d layers (%d Mamba2: %d heads x %d, state %d), %s parameters%s, %s on %s",
             model_dir, arch.name, dims.num_layers, s.num_layers if s else 0, s.num_heads if s else 0,
             s.head_dim if s else 0, s.state_size if s else 0, f"{sum(p.numel() for p in model.parameters()):,}",
             shard, dtype, device)
    return model, cfg

"""Architecture registry: ``config.json``'s ``architectures[0]`` (else its ``model_type``) → how to read the
config and which model class to build. A new family is one entry here, a config adapter
(``hybrid_config.py``) and a module with its layers under Hugging Face's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mambaserve.server.model import hybrid_config
from mambaserve.server.model.bamba import BambaForCausalLM
from mambaserve.server.model.config import Mamba2Dims, ModelLoadError
from mambaserve.server.model.granite_hybrid import GraniteMoeHybridForCausalLM
from mambaserve.server.model.mamba2 import Mamba2ForCausalLM
from mambaserve.server.model.nemotron_h import NemotronHForCausalLM


@dataclass(frozen=True)
class Architecture:
    name: str  # Hugging Face's class name, as config.json's architectures[0] writes it
    model_type: str  # config.json's model_type
    read_dims: Callable[[dict], object]  # config.json -> the dims the model class takes
    model_class: type
    hybrid: bool  # has attention or feed-forward layers besides Mamba2 (paged KV, fewer engine features)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("Mamba2ForCausalLM", "mamba2", Mamba2Dims.from_dict, Mamba2ForCausalLM, hybrid=False),
    Architecture("NemotronHForCausalLM", "nemotron_h", hybrid_config.nemotron_h, NemotronHForCausalLM, hybrid=True),
    Architecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", hybrid_config.granite_hybrid,
                 GraniteMoeHybridForCausalLM, hybrid=True),
    Architecture("BambaForCausalLM", "bamba", hybrid_config.bamba, BambaForCausalLM, hybrid=True),
)}


def resolve(cfg: dict) -> Architecture:
    """The architecture ``cfg`` (a parsed config.json) names; ModelLoadError naming those served if none."""
    archs = cfg.get("architectures") or []
    if archs:
        arch = ARCHITECTURES.get(archs[0])
    else:
        arch = next((a for a in ARCHITECTURES.values() if a.model_type == cfg.get("model_type")), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs[0] if archs else cfg.get('model_type')!r}: this "
                             f"server runs {', '.join(ARCHITECTURES)}")
    return arch

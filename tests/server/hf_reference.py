"""Reference generations from transformers' own Mamba2ForCausalLM (the oracle for engine tests)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _model(path: str):
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (eos ignored) and the logprob of each chosen token, via full forwards."""
    model = _model(str(path))
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt):], lps


def hf_norm_is_grouped() -> bool:
    """transformers < 5.2x normalises the gated RMSNorm over all of d_inner, wrong for n_groups > 1."""
    import inspect

    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    return "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every prompt position, ``[len(prompt), V]`` (one forward)."""
    with torch.no_grad():
        return torch.log_softmax(_model(str(path))(torch.tensor([prompt]), use_cache=False).logits[0].float(), -1)

"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Logprobs are those of the model's distribution (log-softmax of the raw logits), as OpenAI and SGLang
report them, independent of the sampling filters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.server.request import SamplingParams


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row by row's parameters; returns probabilities."""
    dev = logits.device
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    V = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if (top_k < V).any() or (top_p < 1).any():
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=dev)[None, :]
        # keep a token if it is within top-k and the mass before it is below top-p (the top token always stays)
        cum_before = sorted_p.cumsum(-1) - sorted_p
        keep = (rank < top_k[:, None]) & (cum_before < top_p[:, None])
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if (min_p > 0).any():
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        probs = probs * (probs >= threshold)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           logprob_rows: list[int], top_logprobs_num: list[int]) -> SampleResult:
    """logits ``[B, V]`` fp32. ``generators[i]`` is the request's own (seeded) generator or None."""
    greedy = [p.greedy for p in params]
    tokens = logits.argmax(-1)
    if not all(greedy):
        probs = _filter(logits, params)
        for i, g in enumerate(generators):
            if not greedy[i]:
                tokens[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    tok_list = tokens.tolist()
    logprobs = top = None
    if logprob_rows:
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        logprobs = [chosen[i] if i in logprob_rows else None for i in range(len(params))]
        k = max(top_logprobs_num)
        if k > 0:
            vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
            top = [list(zip(ids[i][:n], vals[i][:n])) if n else [] for i, n in enumerate(top_logprobs_num)]
    return SampleResult(tok_list, logprobs, top)

"""What a request allows the sampler to pick: ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and a
grammar (structured outputs, tool calls), applied to a step's logits before sampling.

Each constrained request carries a ``Constraint`` built once when it is submitted: a static mask of the
tokens it may sample (allowed ids, one-token bad words), the bad words of several tokens (their last token is
masked where the output ends with the rest), its bias, and its grammar matcher (``engine/grammar.py``). Per
step, ``apply`` fills one packed bitmask row per masked request on the host (the grammar's from its
matcher, ANDed with the static row; llguidance fills a batch's rows on its own threads), uploads it
through pinned memory and applies it in one pass (``kernels.token_mask``); the bias is one indexed add.

A mask that depends on the output (a grammar, bad words of several tokens) needs the previous step's
token on the host: the scheduler then reads that step before sampling this one, while the device runs
this step's forward (docs/architecture.md, "Overlap scheduling").
"""

from __future__ import annotations

import torch

from mambaserve.kernels.token_mask import apply_token_mask
from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.engine.sampling import to_device


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


def _clear(row: torch.Tensor, tokens) -> None:
    """Clear the bits of ``tokens`` in a packed int32 row (in place)."""
    for t in tokens:
        w, b = divmod(t, 32)
        row[w] &= ~(1 << b) if b < 31 else 0x7FFFFFFF


def _packed(tokens, vocab: int) -> torch.Tensor:
    """A packed row allowing exactly ``tokens``."""
    bits = torch.zeros(mask_words(vocab) * 32, dtype=torch.int64)
    bits[list(tokens)] = 1
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bad_word_sequences(tokenizer, words: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Each bad word as token sequences: alone and after a space (how it appears mid-text)."""
    out = []
    for w in words:
        for text in (w, " " + w.lstrip(" ")):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


class Constraint:
    """One request's constraints (see the module's docstring); ``grammar``: an ``engine.grammar.Matcher``."""

    def __init__(self, params: SamplingParams, vocab: int, tokenizer, grammar=None):
        self.vocab, self.grammar = vocab, grammar
        self.bias = list(params.logit_bias)
        seqs = bad_word_sequences(tokenizer, params.bad_words) if params.bad_words else []
        self.bad_sequences = [s for s in seqs if len(s) > 1]
        banned = [s[0] for s in seqs if len(s) == 1]
        static = None
        if params.allowed_token_ids is not None:
            static = _packed(params.allowed_token_ids, vocab)
        if banned:
            static = torch.full((mask_words(vocab),), -1, dtype=torch.int32) if static is None else static
            _clear(static, banned)
        self.static = static

    @property
    def masks(self) -> bool:
        return self.static is not None or bool(self.bad_sequences) or self.grammar is not None

    @property
    def follows_output(self) -> bool:
        """Whether its mask depends on the tokens sampled so far (then they must be on the host)."""
        return self.grammar is not None or bool(self.bad_sequences)

    def accept(self, token: int) -> bool:
        """A sampled token; True when the grammar is complete (the answer ends here)."""
        return self.grammar is not None and self.grammar.accept(token)

    def finish_row(self, row: torch.Tensor, output: list[int]) -> None:
        """The step's mask row after the grammar filled it (if any): ANDed with the static row, bad words' last
        tokens cleared where the output ends with the rest of them."""
        if self.static is not None:
            row &= self.static
        ends = [s[-1] for s in self.bad_sequences if tuple(output[len(output) - len(s) + 1:]) == s[:-1]]
        _clear(row, ends)


def apply(logits: torch.Tensor, reqs: list) -> None:
    """Bias and mask the rows of ``reqs`` (``logits[j]`` is ``reqs[j]``'s) that carry a constraint; finished
    requests (an extra row that only folds a token in) are left alone."""
    live = [(j, r.constraint) for j, r in enumerate(reqs) if r.constraint is not None and not r.finished]
    biased = [(j, t, v) for j, c in live for t, v in c.bias]
    dev = logits.device
    if biased:
        rows, ids, vals = zip(*biased)
        logits.index_put_((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)),
                          to_device(vals, torch.float32, dev), accumulate=True)
    masked = [(j, c, reqs[j]) for j, c in live if c.masks]
    if not masked:
        return
    mask = torch.full((len(masked), mask_words(logits.shape[-1])), -1, dtype=torch.int32)
    grammars = [(c.grammar, i) for i, (_, c, _) in enumerate(masked) if c.grammar is not None]
    if grammars:
        from mambaserve.server.engine.grammar import fill_masks

        fill_masks(grammars, mask)
    for i, (_, c, req) in enumerate(masked):
        c.finish_row(mask[i], req.output_ids)
    if dev.type == "cuda":
        mask = mask.pin_memory().to(dev, non_blocking=True)
    apply_token_mask(logits, mask, to_device([j for j, _, _ in masked], torch.long, dev))

"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs,
frequency / presence / repetition penalties and min_new_tokens.

Logprobs are those of the model's distribution (log-softmax of the raw logits), as OpenAI and SGLang
report them, independent of the sampling filters.

Sampling never waits for the device: ``sample`` returns a ``DeviceSample`` whose tokens stay on the
device (the next decode step reads them there) while their host copies are in flight; the scheduler
reads the host side one step later, after it has launched the next forward (overlap scheduling). So
the penalties count tokens on the device too (``Penalties``: a row of counts per penalized request,
updated from the sampled tokens where they are), and cost nothing in a batch without them.

Sampling never raises for one row's values either: a row whose logits or filtered distribution are not
finite (a NaN, an infinity, nothing left to sample) gets no token. Its host copy carries a status
instead (``NON_FINITE_LOGITS``: the model's output, so its state or input; ``NON_FINITE_SAMPLING``: its
penalties and filters, so its parameters) and that request alone fails when the step is read; its device
token stays a valid id, so the step launched meanwhile runs on for everyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.server.engine.request import SamplingParams


NON_FINITE_LOGITS = -1  # a host token: this row's logits were not finite (before its penalties)
NON_FINITE_SAMPLING = -2  # a host token: its distribution after penalties and filters was not


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a stream synchronisation: a blocking host-to-device copy
    waits for every queued kernel, which would end the overlap of CPU and GPU work."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class DeviceSample:
    """Sampled tokens on the device, with their (and the logprobs') copies to the host in flight."""

    def __init__(self, tokens: torch.Tensor, logprob_rows: list[int], top_logprobs_num: list[int],
                 chosen: torch.Tensor | None = None, top: tuple[torch.Tensor, torch.Tensor] | None = None,
                 host_tokens: torch.Tensor | None = None):
        """``tokens``: what the next step reads on the device; ``host_tokens``: what the host reads (the same,
        with a NON_FINITE status in place of a row's token)."""
        self.tokens = tokens
        self.logprob_rows, self.top_logprobs_num = set(logprob_rows), top_logprobs_num
        device_side = [tokens if host_tokens is None else host_tokens] + ([chosen] if chosen is not None else []) + (list(top) if top else [])
        self._has_chosen, self._has_top = chosen is not None, top is not None
        self._event = None
        if tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_side]
            for h, t in zip(self._host, device_side):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_side

    def result(self) -> SampleResult:
        """Wait for the host copies (only this batch's work, not what was queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        host = iter(self._host)
        tokens = next(host).tolist()
        logprobs = top = None
        if self._has_chosen:
            chosen = next(host).tolist()
            logprobs = [chosen[i] if i in self.logprob_rows else None for i in range(len(tokens))]
        if self._has_top:
            vals, ids = next(host).tolist(), next(host).tolist()
            top = [list(zip(ids[i][:n], vals[i][:n])) if n else [] for i, n in enumerate(self.top_logprobs_num)]
        return SampleResult(tokens, logprobs, top)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p row by row's parameters; returns probabilities."""
    dev = logits.device
    V = logits.shape[-1]
    temp = to_device([max(p.temperature, 1e-5) for p in params], torch.float32, dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    # which filters run is decided from the host-side parameters: testing device tensors would sync
    if any(0 < p.top_k < V for p in params) or any(p.top_p < 1 for p in params):
        top_k = to_device([p.top_k if 0 < p.top_k < V else V for p in params], torch.long, dev)
        top_p = to_device([p.top_p for p in params], torch.float32, dev)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=dev)[None, :]
        # keep a token if it is within top-k and the mass before it is below top-p (the top token always stays)
        cum_before = sorted_p.cumsum(-1) - sorted_p
        keep = (rank < top_k[:, None]) & (cum_before < top_p[:, None])
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, dev)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        probs = probs * (probs >= threshold)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           logprob_rows: list[int], top_logprobs_num: list[int],
           model_finite: torch.Tensor | None = None) -> DeviceSample:
    """logits ``[B, V]``: fp32 (penalized) where any row samples, filters or asks for logprobs; greedy rows alone
    may pass the model's dtype (``needs_fp32``). ``generators[i]`` is the request's own (seeded) generator or
    None. ``model_finite``: which rows' logits were finite before their penalties (None: none was penalized)."""
    greedy = [p.greedy for p in params]
    # one read of the logits for both: NaN or +inf anywhere, or every logit -inf, is no distribution (max
    # propagates NaN); ties go to the first index, as argmax's do
    peak, tokens = logits.max(-1)
    finite = torch.isfinite(peak)
    model_finite = finite if model_finite is None else model_finite
    if not all(greedy):
        probs = _filter(logits, params)
        finite = finite & (torch.isfinite(probs.sum(-1)) | to_device(greedy, torch.bool, logits.device))
        for i, g in enumerate(generators):
            if not greedy[i]:
                # torch.multinomial's own method for one sample (the same tokens for the same generator),
                # without its check: that raises for a NaN row (failing the whole step) and waits for the device
                tokens[i] = (probs[i] / torch.empty_like(probs[i]).exponential_(1, generator=g)).argmax()
    status = torch.where(model_finite, torch.where(finite, tokens, NON_FINITE_SAMPLING), NON_FINITE_LOGITS)
    chosen = top = None
    if logprob_rows:
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
        k = max(top_logprobs_num)
        if k > 0:
            top = logp.topk(min(k, logp.shape[-1]), dim=-1)
            top = (top.values, top.indices)
    return DeviceSample(tokens, logprob_rows, top_logprobs_num, chosen, top, host_tokens=status)


def needs_fp32(reqs: list, edited: bool) -> bool:
    """Whether a step's logits go to fp32 before sampling: for penalties and constraints (``edited``: in-place
    edits of small values), softmax filters and logprobs. A batch of plain greedy rows takes the maximum of the
    model's own logits: at batch 256 an fp32 copy of a 131k vocabulary is 134 MB written and read again."""
    return edited or any(not r.params.greedy or r.return_logprob for r in reqs)


class Penalties:
    """Per penalized request, on the device: how often each token was generated, and which tokens the
    prompt or the output hold (repetition). Rows are assigned on a request's first sample."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counts: torch.Tensor | None = None  # [rows, V] int32
        self.seen: torch.Tensor | None = None  # [rows, V] bool
        self.rows: dict[str, int] = {}
        self.free: list[int] = []

    def _row(self, req, vocab: int) -> int:
        row = self.rows.get(req.rid)
        if row is not None:
            return row
        if not self.free:  # grow by doubling: rows are only made for requests that ask for penalties
            n = 0 if self.counts is None else self.counts.shape[0]
            grow = max(8, n)
            new_counts = torch.zeros(n + grow, vocab, dtype=torch.int32, device=self.device)
            new_seen = torch.zeros(n + grow, vocab, dtype=torch.bool, device=self.device)
            if n:
                new_counts[:n], new_seen[:n] = self.counts, self.seen
            self.counts, self.seen = new_counts, new_seen
            self.free = list(range(n + grow - 1, n - 1, -1))
        row = self.rows[req.rid] = self.free.pop()
        self.counts[row].zero_()
        self.seen[row].zero_()
        prompt = [t for t in req.prompt_ids if 0 <= t < vocab]
        if prompt:
            self.seen[row, to_device(prompt, torch.long, self.device)] = True
        return row

    def apply(self, logits: torch.Tensor, reqs: list) -> list[tuple[int, int]]:
        """Penalize ``logits`` (rows of ``reqs``) in place; returns (batch row, state row) of those penalized."""
        # (a finished request's row only folds its last token in: its counts are gone)
        pairs = [(j, self._row(r, logits.shape[-1])) for j, r in enumerate(reqs) if r.params.penalized and not r.finished]
        if not pairs:
            return pairs
        dev = logits.device
        j = to_device([j for j, _ in pairs], torch.long, dev)
        rows = to_device([r for _, r in pairs], torch.long, dev)
        ps = [reqs[b].params for b, _ in pairs]
        freq = to_device([p.frequency_penalty for p in ps], torch.float32, dev)[:, None]
        pres = to_device([p.presence_penalty for p in ps], torch.float32, dev)[:, None]
        counts = self.counts[rows].float()
        x = logits[j] - freq * counts - pres * (counts > 0)
        if any(p.repetition_penalty != 1.0 for p in ps):
            rep = to_device([p.repetition_penalty for p in ps], torch.float32, dev)[:, None]
            x = torch.where(self.seen[rows], torch.where(x > 0, x / rep, x * rep), x)
        logits[j] = x
        return pairs

    def count(self, tokens: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        dev = tokens.device
        j = to_device([j for j, _ in pairs], torch.long, dev)
        rows = to_device([r for _, r in pairs], torch.long, dev)
        tok = tokens[j]
        self.counts.index_put_((rows, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)
        self.seen[rows, tok] = True

    def forget(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.free.append(row)


def hold_stops(logits: torch.Tensor, reqs: list) -> None:
    """``min_new_tokens``: a request's stop tokens (EOS included) cannot be sampled before it has that many."""
    rows, ids = [], []
    for j, r in enumerate(reqs):
        if r.params.min_new_tokens and r.stop_token_ids:
            sampled = len(r.output_ids) + (r.pending is not None)  # the unread token of the step before counts
            if sampled < r.params.min_new_tokens:
                stops = [t for t in r.stop_token_ids if 0 <= t < logits.shape[-1]]
                rows += [j] * len(stops)
                ids += stops
    if rows:
        logits[to_device(rows, torch.long, logits.device), to_device(ids, torch.long, logits.device)] = float("-inf")


@dataclass
class Launched:
    """A launched step whose sampled tokens the host has not read yet."""

    rows: list  # the request (engine.request.Req) of each sampled row
    sample: DeviceSample


class Sampler:
    """The scheduler's sampling: a generator per seeded request, one shared default for the rest."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.default = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.penalties = Penalties(device)

    def seed(self, req) -> None:
        if req.params.seed is not None:
            self.generators[req.rid] = torch.Generator(device=self.device).manual_seed(req.params.seed)

    def forget(self, rid: str) -> None:
        self.generators.pop(rid, None)
        self.penalties.forget(rid)

    @torch.inference_mode()  # the logits are the forward's inference tensors: penalties edit them in place
    def launch(self, logits: torch.Tensor, rows: list[int], reqs: list) -> Launched:
        """Sample ``logits[rows]`` (one row per sequence of the step) for ``reqs``, without waiting."""
        if len(rows) < logits.shape[0]:
            logits = logits.index_select(0, to_device(rows, torch.long, logits.device))
        pairs, model_finite = [], None
        penalized = any(r.params.penalized or r.params.min_new_tokens for r in reqs)
        constrained = any(r.constraint is not None for r in reqs)  # logit_bias, allowed tokens, bad words, grammars
        if needs_fp32(reqs, penalized or constrained):
            logits = logits.float()
        if penalized or constrained:
            model_finite = torch.isfinite(logits.amax(-1))  # (the model's part, told apart from the penalties')
        if penalized:
            # logprobs report the distribution sampled from: penalized (as vLLM and SGLang report them)
            pairs = self.penalties.apply(logits, reqs)
            hold_stops(logits, reqs)
        if constrained:
            from mambaserve.server.engine import constraints  # (it uploads through to_device: imported late)

            constraints.apply(logits, reqs)
        result = sample(logits, [r.params for r in reqs], [self.generators.get(r.rid, self.default) for r in reqs],
                        [j for j, r in enumerate(reqs) if r.return_logprob],
                        [r.top_logprobs_num if r.return_logprob else 0 for r in reqs], model_finite)
        self.penalties.count(result.tokens, pairs)
        launched = Launched(reqs, result)
        for j, req in enumerate(reqs):
            req.pending = (launched, j)
        return launched

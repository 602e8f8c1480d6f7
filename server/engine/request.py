"""A request as the scheduler sees it, and what it reports back to the HTTP side."""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from mambaserve.server.engine.detokenizer import IncrementalDetokenizer
from mambaserve.server.engine.timeline import Timeline


class BadRequest(ValueError):
    """Client error: becomes a 400 (or ``status``) with this message and an OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


class Overloaded(BadRequest):
    """The queue is full: 503 with Retry-After; the client should come back."""

    retry_after_s = 1

    def __init__(self, message: str):
        super().__init__(message, code="overloaded", status=503)


FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 0.01  # logits up to 1e31 stay finite divided by it and by the 1e-5 temperature floor


def as_float32(value: float) -> float:
    """``value`` rounded to float32 as the sampler's tensors hold it (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # (older Pythons refuse to pack what float32 cannot hold)
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0  # minus this x times each token was generated, on its logit
    presence_penalty: float = 0.0  # minus this once a token was generated
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or the output: / it if positive, x it if not
    min_new_tokens: int = 0  # stop tokens and EOS cannot end the answer before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # words whose last token is masked where the output would complete them
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) stays in the text
    # a grammar the answer must follow: (kind, source), kind in engine.grammar.KINDS; compiled by the engine
    constraint: tuple[str, str] | None = None
    # the request's own spelling of fields its API names differently (OpenAI's max_tokens for max_new_tokens):
    # an error names the field the client sent, not ours
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def name(self, attr: str) -> str:
        """The client's name for the field ``attr``."""
        return self.names.get(attr, attr)

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Refuse values the sampler cannot use, judged as it sees them: in float32, where 1e-46 is 0 and
        1e39 is infinite (the step would fail for this request, which the sampler also catches: one that
        slips through fails alone, see ``sampling.NON_FINITE``)."""
        name = self.name
        values = {}
        for attr in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, attr)
            if not math.isfinite(value):
                raise BadRequest(f"{name(attr)} must be a finite number, got {value}")
            values[attr] = as_float32(value)
            if not math.isfinite(values[attr]):
                raise BadRequest(f"{name(attr)} must be a finite 32-bit float (at most {FLOAT32_MAX:.4g}), got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise BadRequest(f"{name('seed')} must be in [0, 2**63), got {self.seed}")
        if self.max_new_tokens < 0:
            raise BadRequest(f"{name('max_new_tokens')} must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise BadRequest(f"{name('temperature')} must be >= 0, got {self.temperature}")
        if not 0 < values["top_p"] <= 1:
            zero = " (it is 0 as a 32-bit float)" if 0 < self.top_p <= 1 else ""
            raise BadRequest(f"{name('top_p')} must be in (0, 1], got {self.top_p}{zero}")
        if not 0 <= self.min_p <= 1:
            raise BadRequest(f"{name('min_p')} must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise BadRequest(f"{name('stop')} strings must be non-empty")
        for attr in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, attr) <= 2:
                raise BadRequest(f"{name(attr)} must be in [-2, 2], got {getattr(self, attr)}")
        # a logit divided by a tiny penalty overflows float32 (1e-39: every seen token's logit infinite)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            raise BadRequest(f"{name('repetition_penalty')} must be in [{MIN_REPETITION_PENALTY:g}, 2], "
                             f"got {self.repetition_penalty}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise BadRequest(f"{name('min_new_tokens')} must be in [0, {name('max_new_tokens')}="
                             f"{self.max_new_tokens}], got {self.min_new_tokens}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise BadRequest(f"{name('logit_bias')} values must be in [-100, 100], got {bias} for token {token}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise BadRequest(f"{name('allowed_token_ids')} must not be empty")
        if any(not w for w in self.bad_words):
            raise BadRequest(f"{name('bad_words')} must be non-empty strings")
        if self.constraint is not None and self.min_new_tokens:  # (the grammar says where the answer ends)
            raise BadRequest(f"{name('min_new_tokens')} cannot be combined with a grammar constraint "
                             f"({name('constraint')})", code="unsupported_parameter")

    def token_ids(self) -> list[int]:
        """Every token id the parameters name (checked against the vocabulary by the engine)."""
        return [t for t, _ in self.logit_bias] + list(self.allowed_token_ids or ())

    @property
    def constrained(self) -> bool:
        """Whether some tokens are masked or biased before sampling (engine/constraints.py)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words or self.constraint)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def fit_to_context(prompt_len: int, params: SamplingParams, context_length: int, max_tokens_explicit: bool,
                   what: str = "the prompt") -> SamplingParams:
    """``params`` with ``max_new_tokens`` fitted to the room the context leaves after the prompt; raises
    BadRequest when the prompt leaves none, or when an explicit ``max_new_tokens`` does not fit."""
    room = context_length - prompt_len
    if room <= 0:
        raise BadRequest(f"{what} has {prompt_len} tokens; this model's context length is {context_length}",
                         code="context_length_exceeded")
    if params.max_new_tokens > room:
        if max_tokens_explicit:
            raise BadRequest(f"prompt ({prompt_len} token{'s' * (prompt_len != 1)}) + {params.name('max_new_tokens')} "
                             f"({params.max_new_tokens}) exceeds the context length {context_length}",
                             code="context_length_exceeded")
        params = dataclasses.replace(params, max_new_tokens=room)
    return params


class FinishReason(str, enum.Enum):
    STOP = "stop"  # stop token or stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # client disconnect or /abort_request


@dataclass
class StepOutput:
    """One increment for the client: new tokens and text, and the totals so far."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    error_status: int | None = None  # set when the request was refused before running (HTTP status)
    error_code: str | None = None
    # logprobs of the prompt's tokens from logprob_start_len on (None: the first token, which nothing
    # predicts), in the request's first output only
    input_logprobs: list[float | None] | None = None
    input_token_ids: list[int] | None = None  # the prompt's tokens they are of
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    session_persisted: bool | None = None  # a --session-persist turn's last output: whether it is on storage

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    emit: Callable[[StepOutput], None]
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: report the prompt's logprobs from this position on (-1: none)
    stream: bool = True  # emit every increment; False: only the final output
    stop_token_ids: frozenset[int] = frozenset()
    constraint: object | None = None  # engine.constraints.Constraint: bias, masks, grammar (constrained params)
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    in_state: int = 0  # tokens of prompt + output already folded into the slot's state
    cached_tokens: int = 0
    expected_cached: int = 0  # the cache's match when it arrived (admission's estimate of its prefill)
    arrival_tick: int = 0  # the cache's recency clock when it arrived (admission._speculative_horizon)
    overtaken: int = 0  # admission rounds in which a later request was admitted while it waited
    locked_node: object | None = None  # radix node whose snapshot is being copied in (unlocked after the copy)
    kv: object | None = None  # cache.pages.KVHold: its KV pages, from admission to its end (hybrid models)
    # (slot, tokens it covers): its state at the last page boundary it decoded past (engine/rolling_snapshots.py)
    rolling: tuple[int, int] | None = None
    session_id: str | None = None
    turn_params: object | None = None  # sessions.table.TurnParams
    session: object | None = None  # sessions.table.Session, once the turn is accepted
    folding: bool = False  # finished; its last token runs once more so the session's state covers it
    pending: tuple[object, int] | None = None  # (launched step, row) sampling its next token, unread yet
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    timeline: Timeline | None = None  # where its time to first byte goes (HTTP requests)
    follows: Req | None = None  # another answer to the same prompt: admitted once that one has prefilled it
    group: str = ""  # the rid of the first of a request's n choices (its own rid alone): admission's fairness
    prefetch: object | None = None  # cache.storage_tier.Prefetch: its prefix being read from the storage tier
    revived: bool = False  # its session was looked up in the storage tier already (--session-persist)
    persisted: bool | None = None  # --session-persist: whether this turn was written to storage (once known)
    last_token_time: float | None = None
    # what has been sent to the client
    sent_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_sent: bool = False

    @property
    def logits_from(self) -> int | None:
        """The first prompt position whose logits the prompt's logprobs need (they predict the token
        after it), or None without input logprobs. The state before it may come from a cache; the
        positions from it on must be computed."""
        if self.logprob_start_len < 0:
            return None
        return max(self.logprob_start_len - 1, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Prompt tokens run as prefill: all of them (the pass over the last one samples the first token),
        except where only the last one is left (a cache hit or a chunk ended there): that one runs as a
        decode row (2.3 ms at the 2.7b shape on an H100, where a one-token prefill takes 5.4)."""
        n = len(self.prompt_ids)
        return n - 1 if self.in_state == n - 1 else n

    @property
    def prefill_done(self) -> bool:
        return self.in_state >= self.prefill_len

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, n: int) -> list[int]:
        """The first n tokens of prompt + output."""
        return (self.prompt_ids + self.output_ids)[:n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestQueues:
    """The scheduler's requests: waiting for admission (arrival order), running (holding a slot), all by id."""

    def __init__(self) -> None:
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}

    def add(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def start(self, req: Req) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        if req.timeline is not None:
            req.timeline.mark("admitted")

    def remove(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.by_rid.pop(req.rid, None)

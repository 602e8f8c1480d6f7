"""Request bodies of the HTTP API (pydantic), and their translation into SamplingParams.

Unknown fields are ignored (clients send many); known fields of the wrong type are a 422.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from mambaserve.server.engine.request import BadRequest, SamplingParams
from mambaserve.server.sessions.table import OpenParams, TurnParams


def _check_text(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} is not well-formed unicode (a lone surrogate?)") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_text(v, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, where)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="after")
    def _well_formed_text(self):
        # a string the tokenizer cannot encode must be a 4xx here, not an exception in a handler
        for name in type(self).model_fields:
            _check_text(getattr(self, name), name)
        return self


# Fields other servers implement and this one does not: a request that sets one (to anything but its
# no-op value: null, false, "", [], {}) is refused with 400 ``unsupported_parameter``, never answered as if
# it had not been sent. (sglang-router adds some with their no-op values, e.g. return_hidden_states: false.)
UNSUPPORTED_OPENAI = frozenset({
    "logit_bias", "suffix", "tools", "functions", "continue_final_message", "no_stop_trim", "lora_path",
    "regex", "json_schema", "ebnf", "structural_tag", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "return_hidden_states"})
UNSUPPORTED_NATIVE = frozenset({
    "image_data", "audio_data", "video_data", "input_embeds", "lora_path", "return_hidden_states",
    "return_entropy", "return_bytes", "custom_logit_processor", "token_ids_logprob", "bootstrap_host"})
UNSUPPORTED_NATIVE_SAMPLING = frozenset({
    "regex", "json_schema", "ebnf", "structural_tag", "stop_regex", "custom_params", "logit_bias"})


def _refuse_unsupported(extra: dict[str, Any] | None, names: frozenset[str], where: str = "") -> None:
    for name in sorted(names & set(extra or {})):
        if extra[name] not in (None, False, "", [], {}):
            raise BadRequest(f"{where}{name} is not supported by this server", code="unsupported_parameter")


ROUTING_KEY = "x-smg-routing-key"  # sglang-router's sticky key (policy manual), which it forwards


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class _OpenAISampling(_Body):
    model_config = ConfigDict(extra="allow")  # (to see the fields refused by check_supported)
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # (vLLM's extension)
    min_tokens: int = 0  # (vLLM's name for min_new_tokens)
    session_id: str | None = None
    session_params: "SessionParams | None" = None  # (what sglang-router forwards; session_id it drops)

    def check_supported(self) -> None:
        """400 for a field set that this server does not implement (UNSUPPORTED_OPENAI)."""
        _refuse_unsupported(self.model_extra, UNSUPPORTED_OPENAI)
        extra = self.model_extra or {}
        best_of = extra.get("best_of")
        if best_of is not None and best_of not in (1, self.n):
            raise BadRequest("best_of other than n is not supported by this server", code="unsupported_parameter")
        fmt = extra.get("response_format")
        if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise BadRequest("response_format other than text is not supported by this server",
                             code="unsupported_parameter")

    def sampling(self, max_tokens: int, max_tokens_name: str = "max_tokens") -> SamplingParams:
        """The engine's parameters; ``max_tokens_name``: the field the token limit came in (chat has two)."""
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              min_new_tokens=self.min_tokens,
                              names={"max_new_tokens": max_tokens_name, "min_new_tokens": "min_tokens"})

    def session(self, headers) -> tuple[str | None, TurnParams | None]:
        """The session this request is a turn of: ``session_params`` (the one form sglang-router forwards),
        else the ``x-session-id`` header or the ``session_id`` field; and the turn's parameters."""
        if self.session_params is not None:
            return self.session_params.session_id(headers), self.session_params.turn()
        return headers.get("x-session-id") or self.session_id, None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    max_tokens: int | None = Field(default=None)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("the prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        # (OpenAI refuses it too: answering without the alternatives asked for would drop them silently)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class NativeSampling(_Body):
    model_config = ConfigDict(extra="allow")  # (to see the fields refused by GenerateRequest.check_supported)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = Field(default=1, ge=1)

    def params(self) -> SamplingParams:
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              min_new_tokens=self.min_new_tokens,
                              names={"seed": "sampling_seed"} if self.sampling_seed is not None else {})


class GenerateRequest(_Body):
    model_config = ConfigDict(extra="allow")  # (to see the fields refused by check_supported)
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    logprob_start_len: int = Field(default=-1, ge=-1)  # with return_logprob: the prompt's logprobs from here
    return_text_in_logprobs: bool = False
    rid: str | None = None
    session_params: "SessionParams | None" = None

    def check_supported(self) -> None:
        """400 for a field set that this server does not implement (UNSUPPORTED_NATIVE, ..._SAMPLING)."""
        _refuse_unsupported(self.model_extra, UNSUPPORTED_NATIVE)
        _refuse_unsupported(self.sampling_params.model_extra, UNSUPPORTED_NATIVE_SAMPLING, "sampling_params.")

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, text or ids, one or a batch."""
        p = self.text if self.text is not None else self.input_ids
        if not self.batched:
            return [p]
        if not p:
            raise BadRequest("the batch of prompts is empty")
        return list(p)


class AbortRequest(_Body):
    rid: str


class SessionParams(_Body):
    """A session turn. ``open``/``close`` (with ``streaming``, ``timeout``, ``capacity_of_str_len`` for
    ``open``) let a turn open its session first and close it after: what a client behind sglang-router
    does, which does not proxy ``/open_session`` and ``/close_session`` but forwards ``session_params``."""

    id: str | None = Field(default=None, min_length=1, max_length=128)  # default: the x-smg-routing-key header
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    open: bool = False
    streaming: bool = False
    timeout: float | None = Field(default=None, allow_inf_nan=False)
    capacity_of_str_len: int | None = Field(default=None, ge=0)
    close: bool = False
    secret: str | None = Field(default=None, max_length=256)  # the session's (x-session-secret at its opening)

    def session_id(self, headers) -> str:
        """``id``, else the routing key: behind sglang-router the session id need be given only once."""
        sid = self.id or headers.get(ROUTING_KEY)
        if not sid:
            raise BadRequest(f"session_params needs an id (or the {ROUTING_KEY} header)")
        if len(sid) > 128:
            raise BadRequest("a session id has at most 128 characters")
        return sid

    def turn(self) -> TurnParams:
        opening = OpenParams(self.streaming, self.timeout, self.capacity_of_str_len) if self.open else None
        return TurnParams(self.rid, self.offset, self.replace, self.drop_previous_output, opening, self.close)


class OpenSessionRequest(_Body):
    capacity_of_str_len: int | None = Field(default=None, ge=0)
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    streaming: bool = False
    timeout: float | None = Field(default=None, allow_inf_nan=False)


class CloseSessionRequest(_Body):
    session_id: str
    session_secret: str | None = Field(default=None, max_length=256)


class SnapshotRequest(_Body):
    name: str | None = None
    session_secret: str | None = Field(default=None, max_length=256)


class RestoreRequest(_Body):
    name: str
    session_id: str | None = None
    session_secret: str | None = Field(default=None, max_length=256)


for _model in (CompletionRequest, ChatRequest, GenerateRequest):
    _model.model_rebuild()

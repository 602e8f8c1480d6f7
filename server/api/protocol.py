"""Request bodies of the HTTP API (pydantic), and their translation into SamplingParams.

Unknown fields are ignored (clients send many); known fields of the wrong type are a 422 (a value out of a field's
bounds a 400: app.py), strictly: no string is taken for a number or a boolean, no number for a boolean (pydantic's
strict mode).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from mambaserve.server.engine.request import BadRequest, SamplingParams
from mambaserve.server.sessions.table import OpenParams, TurnParams


def _check_text(value: Any, where: str) -> None:
    if isinstance(value, str):
        if value.isascii():  # (a flag of the string: no copy)
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} is not well-formed unicode (a lone surrogate?)") from None
    elif isinstance(value, (list, tuple)):
        try:
            sum(value)  # numbers only, no text inside (a prompt's thousands of ids: 5x faster than the loop below)
            return
        except TypeError:  # a string, a list, None... somewhere in it
            pass
        for v in value:
            if type(v) is not int:
                _check_text(v, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, where)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="after")
    def _well_formed_text(self):
        # a string the tokenizer cannot encode must be a 4xx here, not an exception in a handler (each nested
        # model checks its own fields; __dict__ holds the fields' values, read once per request on the event loop)
        for name, value in self.__dict__.items():
            if value is not None and not isinstance(value, _NO_TEXT):
                _check_text(value, name)
        return self


_NO_TEXT = (bool, int, float, BaseModel)


# Fields other servers implement and this one does not: a request that sets one (to anything but its
# no-op value: null, false, "", [], {}) is refused with 400 ``unsupported_parameter``, never answered as if
# it had not been sent. (sglang-router adds some with their no-op values, e.g. return_hidden_states: false.)
UNSUPPORTED_OPENAI = frozenset({
    "suffix", "functions", "function_call", "lora_path", "structural_tag", "return_hidden_states", "use_beam_search",
    "guided_decoding_backend", "guided_whitespace_pattern", "logits_processors"})
UNSUPPORTED_NATIVE = frozenset({
    "image_data", "audio_data", "video_data", "input_embeds", "lora_path", "return_hidden_states",
    "return_entropy", "return_bytes", "custom_logit_processor", "token_ids_logprob", "bootstrap_host"})
UNSUPPORTED_NATIVE_SAMPLING = frozenset({"structural_tag", "stop_regex", "custom_params"})


def _refuse_unsupported(extra: dict[str, Any] | None, names: frozenset[str], where: str = "") -> None:
    for name in sorted(names & set(extra or {})):
        if extra[name] not in (None, False, "", [], {}):
            raise BadRequest(f"{where}{name} is not supported by this server", code="unsupported_parameter")


ROUTING_KEY = "x-smg-routing-key"  # sglang-router's sticky key (policy manual), which it forwards


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        try:
            out.append((int(key), value))
        except ValueError:
            raise BadRequest(f"logit_bias keys are token ids, got {key!r}") from None
    return tuple(out)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> tuple[str, str]:
        if self.type == "json_object":
            return ("json_object", "")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest("response_format json_schema needs json_schema.schema")
        schema = self.json_schema.schema_
        return ("json_schema", json.dumps(_closed(schema) if self.json_schema.strict else schema))


def _closed(schema: Any) -> Any:
    """``strict``: objects take no property their schema does not name (OpenAI's strict mode asks for
    ``additionalProperties: false`` everywhere; where a schema leaves it out, it is meant)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k != "const" and k != "enum" and k != "default" else v for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> tuple[str, str]:
        set_ = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise BadRequest("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
        kind = set_[0]
        if kind == "json_":
            return ("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if kind == "choice":
            return ("choice", json.dumps(self.choice))
        if kind == "grammar":
            return ("ebnf", self.grammar)
        return ("json_object", "") if kind == "json_object" else ("regex", self.regex)


def _grammar_fields(body: BaseModel, fields: tuple[tuple[str, str], ...]) -> list[tuple[str, tuple[str, str]]]:
    """``(field, (grammar kind, source))`` for each of ``fields`` (field, kind) that ``body`` sets; a JSON value
    as its text."""
    return [(name, (kind, value if isinstance(value, str) else json.dumps(value)))
            for name, kind in fields if (value := getattr(body, name)) is not None]


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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None  # (vLLM's)
    bad_words: list[str] | None = None  # (vLLM's)
    include_stop_str_in_output: bool = False  # (vLLM's)
    no_stop_trim: bool = False  # (SGLang's name for include_stop_str_in_output)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # (vLLM's) only the prompt's last k tokens
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # (vLLM's) the prompt's tokens' logprobs
    best_of: int | None = None  # only 1 or n: every answer generated is returned
    # structured outputs, in each form clients send them (at most one per request): OpenAI's, vLLM's, SGLang's
    response_format: "ResponseFormat | None" = None
    structured_outputs: "StructuredOutputs | None" = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    session_id: str | None = None
    session_params: "SessionParams | None" = None  # (what sglang-router forwards; session_id it drops)

    def check_supported(self) -> None:
        """400 for a field set that this server does not implement (UNSUPPORTED_OPENAI)."""
        _refuse_unsupported(self.model_extra, UNSUPPORTED_OPENAI)
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise BadRequest("best_of other than 1 or n is not supported by this server", code="unsupported_parameter")

    def constraint(self) -> tuple[tuple[str, str] | None, str | None]:
        """The grammar the answer must follow, from whichever field asked for one, and that field's name."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", self.response_format.constraint()))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.constraint()))
        found += _grammar_fields(self, (("guided_json", "json_schema"), ("guided_regex", "regex"),
                                        ("guided_choice", "choice"), ("guided_grammar", "ebnf"), ("regex", "regex"),
                                        ("json_schema", "json_schema"), ("ebnf", "ebnf")))
        if len(found) > 1:
            raise BadRequest(f"at most one structured output per request; got {', '.join(n for n, _ in found)}")
        return (found[0][1], found[0][0]) if found else (None, None)

    def sampling(self, max_tokens: int, max_tokens_name: str = "max_tokens") -> SamplingParams:
        """The engine's parameters; ``max_tokens_name``: the field the token limit came in (chat has two)."""
        constraint, source = self.constraint()
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              min_new_tokens=self.min_tokens, logit_bias=_logit_bias(self.logit_bias),
                              allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                              bad_words=tuple(self.bad_words or ()),
                              include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
                              constraint=constraint,
                              names={"max_new_tokens": max_tokens_name, "min_new_tokens": "min_tokens",
                                     "constraint": source or "response_format"})

    def truncated(self, ids: list[int]) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last k tokens."""
        k = self.truncate_prompt_tokens
        return ids[-k:] if k else ids

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
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

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

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content; a call's JSON arguments as an object."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest("an assistant message's tool_calls need function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise BadRequest(f"tool call {fn['name']!r}: arguments are not JSON") from None
    return {**call, "type": "function", "function": {**fn, "arguments": args}}


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # (vLLM's) the last (assistant) message is continued, not closed
    echo: bool = False  # (vLLM's) the answer starts with the last message's content when that is the assistant's

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        # (OpenAI refuses it too: answering without the alternatives asked for would drop them silently)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def template_args(self) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages (BadRequest for what cannot go together)."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise BadRequest("continue_final_message needs add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise BadRequest("continue_final_message needs the last message to be the assistant's")
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(set(kwargs) & RESERVED_TEMPLATE_ARGS)
        if taken:
            raise BadRequest(f"chat_template_kwargs cannot set {', '.join(taken)} (fields of their own)")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, **kwargs}

    @property
    def echoed(self) -> str:
        """``echo``: the text the answer starts with."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


# what a chat template gets from the request's own fields, never from chat_template_kwargs
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                    "continue_final_message", "tokenize", "chat_template", "return_dict",
                                    "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                    "return_tensors"})


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
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool = False  # the matched stop string stays in the text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def params(self) -> SamplingParams:
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        grammars = _grammar_fields(self, (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf")))
        if len(grammars) > 1:
            raise BadRequest(f"at most one of json_schema, regex, ebnf; got {', '.join(n for n, _ in grammars)}")
        names = {"seed": "sampling_seed"} if self.sampling_seed is not None else {}
        if grammars:
            names["constraint"] = grammars[0][0]
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              skip_special_tokens=self.skip_special_tokens, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              min_new_tokens=self.min_new_tokens, logit_bias=_logit_bias(self.logit_bias),
                              include_stop_str_in_output=self.no_stop_trim,
                              constraint=grammars[0][1] if grammars else None,
                              names=names)


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


class TokenizeRequest(_Body):
    """``/tokenize`` (vLLM's form: a prompt, or chat messages rendered as a chat request would be) and
    ``/v1/tokenize`` (SGLang's: a prompt or a list of them)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = False  # (the server itself never adds any to a prompt)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt] | list[list[StrictInt]]


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


for _model in (CompletionRequest, ChatRequest, GenerateRequest, TokenizeRequest):
    _model.model_rebuild()

"""Response bodies as the OpenAPI document declares them (``/openapi.json``).

They document what the handlers return; handlers build plain dicts, and the schema fuzz test
(tests/server/test_openapi_fuzz.py) checks real responses against these models. Every operation
declares the error statuses it can answer, each with the error envelope.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    code: str


class ErrorBody(_Out):
    error: ErrorDetail


ERROR_STATUSES = {
    400: "invalid request (malformed JSON, values out of range, prompt too long, ...)",
    401: "missing or wrong API key (servers started with --api-key)",
    403: "a session (or its snapshot) used without its secret or with another API key than its opener's",
    404: "unknown model, session, turn or snapshot",
    408: "the request's headers or body did not arrive within --http-header-timeout / --http-body-timeout",
    409: "conflict: duplicate request id, busy session, existing session or snapshot, cache busy",
    413: "request body over --max-request-bytes",
    422: "a field of the wrong type or a required one missing, a body that is not a JSON object",
    429: "too many open sessions (in all, or for this client), or a snapshot quota reached",
    500: "internal error (the server log has the details); other requests are unaffected",
    503: "overloaded (queue full or too many connections; see Retry-After) or not ready",
    504: "the request ran past --request-timeout",
    507: "the snapshot directory's quota is reached",
}
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorBody, "description": d} for s, d in ERROR_STATUSES.items()}


def streamed(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON (``model``) or, with ``"stream": true``, server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


PLAIN_TEXT: dict[int | str, dict[str, Any]] = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(_Out):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallOut(_Out):
    id: str
    type: str
    function: dict[str, str]


class ChatMessageOut(_Out):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(_Out):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: str
    data: list[ModelCard]


class GenerateMeta(_Out):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    # with return_logprob: [logprob, token id, text or null]; the input ones with logprob_start_len >= 0
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None


class GenerateResponse(_Out):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class ModelInfo(_Out):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool
    architecture: str
    context_length: int


class ServerInfo(_Out):
    model_path: str
    served_model_name: str
    context_length: int
    internal_states: list[dict[str, int]]


class Load(_Out):
    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int


class Success(_Out):
    success: bool


class FlushResult(Success):
    freed_snapshots: int


class SnapshotResult(_Out):
    name: str
    bytes: int
    tokens: int
    has_state: bool


class RestoreResult(_Out):
    session_id: str
    tokens: int
    has_state: bool


class TokenizeResult(_Out):
    tokens: list[int] | list[list[int]]
    count: int
    max_model_len: int
    token_strs: list[str] | list[list[str]] | None = None


class DetokenizeResult(_Out):
    prompt: str | list[str]
    text: str | list[str]


class Version(_Out):
    version: str

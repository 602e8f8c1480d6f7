"""Grammars for structured outputs, on llguidance: compiled once per (kind, source) and cached, one matcher
per request, masks filled on the host.

Why llguidance: on this project's CPU at a 50k vocabulary it compiled a realistic JSON schema in 3 ms
against xgrammar's 1.4 s (agents send a new tool schema with many requests) for the same per-token mask
time (0.07 ms mean); ``benchmarks/grammar_engines.py`` measures both.

Kinds: ``json_schema`` (a schema, as text), ``json_object`` (any JSON object), ``regex``, ``choice`` (a JSON
list of strings: exactly one of them), ``lark`` (llguidance's Lark dialect, which can embed JSON schemas:
tool calls use it) and ``ebnf`` (GBNF, as llama.cpp and SGLang's ``ebnf`` write it, or Lark). JSON comes out
compact (``{"a": 1, "b": [2, 3]}``): no free whitespace a model could loop in.
"""

from __future__ import annotations

import collections
import json
import threading

from mambaserve.server.engine.request import BadRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "ebnf")
JSON_OPTIONS = {"whitespace_flexible": False}


class Matcher:
    """One request's place in its grammar (used on the scheduler thread only)."""

    def __init__(self, m):
        self.m = m

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; True once the answer must end (the grammar is complete, or the token
        was not allowed: only a stop token can follow)."""
        self.m.consume_token(token)
        return self.m.is_stopped()


class Compiled:
    """A checked grammar; ``matcher()`` copies its template (cheap: the lexer built so far is shared)."""

    def __init__(self, template):
        self._template, self._lock = template, threading.Lock()

    def matcher(self) -> Matcher:
        with self._lock:
            return Matcher(self._template.deep_copy())


def _llguidance_grammar(kind: str, source: str) -> str:
    import llguidance

    M = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError as e:
            raise BadRequest(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequest("a JSON schema is an object (or true / false)")
        return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return M.grammar_from_regex(source)
    if kind == "choice":
        choices = json.loads(source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise BadRequest("a choice is a non-empty list of non-empty strings")
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return M.grammar_from_lark(source)
    if kind == "ebnf":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return M.grammar_from_lark(any_to_lark(source))
        except Exception as e:  # (its converter raises plain exceptions for bad input)
            raise BadRequest(f"the grammar is neither GBNF nor Lark: {e}") from None
    raise BadRequest(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")


class Grammars:
    """The engine's grammar compiler and its cache (thread-safe: compiled on worker threads). The
    tokenizer's llguidance form is built on first use (0.4 s at a 50k vocabulary)."""

    def __init__(self, tokenizer, vocab: int, eos_token_ids, capacity: int = 256):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.eos = sorted(t for t in eos_token_ids if 0 <= t < vocab)
        self.capacity = capacity
        self._cache: collections.OrderedDict[tuple[str, str], Compiled] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab,
                                                                      eos_token=self.eos or None)
                except ValueError:  # a decoder it does not know (a word-level vocabulary): token by token
                    self._ll_tokenizer = _by_token(self.tokenizer, self.vocab, self.eos)
            return self._ll_tokenizer

    def compile(self, kind: str, source: str) -> Compiled:
        """The grammar, from the cache or compiled now (BadRequest naming the problem if it is not one)."""
        key = (kind, source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        try:
            grammar = _llguidance_grammar(kind, source)
        except ValueError as e:  # (BadRequest is one too)
            raise e if isinstance(e, BadRequest) else BadRequest(f"invalid {kind}: {e}") from None
        try:
            tokenizer = self._tokenizer()
        except Exception as e:  # (its tokenizer conversion raises plain exceptions)
            raise BadRequest(f"structured outputs are not available for this model's tokenizer: {e}",
                             code="unsupported_parameter") from None
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise BadRequest(f"invalid {kind}: {template.get_error()}")
        compiled = Compiled(template)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled


def _by_token(tokenizer, vocab: int, eos: list[int]):
    """The llguidance tokenizer of a vocabulary whose tokens each decode to whole characters (ids past the
    tokenizer's, a padded vocabulary's, are empty: never allowed)."""
    import llguidance

    special = set(tokenizer.all_special_ids)
    n = len(tokenizer)
    tokens = [(tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode()
              if i < n else b"" for i in range(vocab)]

    class Wrapped:
        eos_token_id, bos_token_id, special_token_ids = (eos or [0])[0], None, sorted(special)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            return tokenizer.encode(text.decode() if isinstance(text, bytes) else text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=vocab)


_executor = None


def fill_masks(matchers: list[tuple[Matcher, int]], mask) -> None:
    """Fill row ``i`` of the packed int32 ``mask`` (host) with each matcher's allowed tokens; several rows on
    llguidance's own threads (it releases the GIL)."""
    import llguidance
    import llguidance.torch as llt

    global _executor
    if len(matchers) == 1:
        m, i = matchers[0]
        llt.fill_next_token_bitmask(m.m, mask, i)
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llt.fill_next_token_bitmask_par(_executor, [(m.m, i) for m, i in matchers], mask)

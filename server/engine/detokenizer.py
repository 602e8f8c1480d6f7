"""Incremental detokenization with stop strings.

Decoding a growing id list one token at a time breaks multi-byte characters and merges; we decode a
short window (from ``prefix_offset``) and only release text once it no longer ends in an incomplete
character. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 prompt_tail: list[int] | None = None, incremental: bool = True, keep_stop: bool = False):
        self.tok = tokenizer
        # Without a client reading increments and without stop strings, decoding once at the end
        # gives the same text for a fraction of the work (two decodes per token otherwise).
        self.lazy = not incremental and not stop
        self.stop = stop
        self.keep_stop = keep_stop  # the matched stop string stays in the text (include_stop_str_in_output)
        self.skip = skip_special_tokens
        # A few prompt tokens as left context, so the first output token decodes with its leading space.
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (up to the stop string, once matched)
        self.sent = 0  # characters of text already released
        self.stopped: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> None:
        if self.stopped is not None:
            return
        self.ids.append(token_id)
        if self.lazy:
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop()

    def _check_stop(self) -> None:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i + len(s) * self.keep_stop]
                self.stopped = s
                return

    def release(self, final: bool = False) -> str:
        """Text safe to send now: all of it when final, else minus a tail that may begin a stop string."""
        if self.lazy:
            if not final:
                return ""
            self.text = self._decode(self.ids)[len(self._decode(self.ids[:self.read_offset])):]
        end = len(self.text)
        if not final and self.stopped is None:
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self.sent:end]
        self.sent = end
        return out

"""What one model step runs: built by the scheduler (plain Python), executed by the model runner.

The scheduler never touches state tensors. The state mutations it decides (copy-on-write of a cached
snapshot into a request's slot, zeroing a slot) ride on the batch as the cache's ``StateOps`` and the
runner executes them on the forward stream *before* the layers run, in list order (docs/design.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mambaserve.server.cache.prefix_cache import StateOps
from mambaserve.server.model.inputs import ForwardMode


@dataclass
class ForwardBatch:
    mode: ForwardMode
    token_ids: list[int]  # packed: every sequence's new tokens, in order
    seq_lens: list[int]  # new tokens per sequence (all 1 for decode)
    start_pos: list[int]  # tokens already in each sequence's state (absolute position of its first new token)
    slots: list[int]  # state slot of each sequence
    state_ops: StateOps = field(default_factory=StateOps)
    all_logits: bool = False  # logits for every token (tests), not only each sequence's last
    # (sequence index, absolute position, slot): write the state after `position` tokens of that
    # sequence into `slot` during the forward (radix cache tracking, extra_buffer)
    track: list[tuple[int, int, int]] = field(default_factory=list)
    # (sequence index, slot) or (sequence index, slot, position): write the state before that sequence's last
    # token, or after `position` tokens of its history (in the chunk scan's last chunk of this call: a hybrid's
    # last page boundary), into `slot` (the radix cache's snapshot of a prompt minus its last token, taken by the
    # pass that samples after the prompt)
    snap: list[tuple[int, ...]] = field(default_factory=list)
    # Overlap scheduling: tokens sampled by the previous step but not yet seen by the host.
    # (position in token_ids, row of prev_tokens): the runner fills those positions on the device.
    from_prev: list[tuple[int, int]] = field(default_factory=list)
    prev_tokens: object | None = None  # torch.Tensor [rows] on the device
    # Prompt logprobs (EXTEND): the logits at these positions of token_ids are computed too, and the
    # logprob of the token after each (``logprob_next``: it is known, the prompt's), with the top
    # ``logprob_top``; ``logprob_owner``: the sequence index each belongs to.
    logprob_at: list[int] = field(default_factory=list)
    logprob_next: list[int] = field(default_factory=list)
    logprob_owner: list[int] = field(default_factory=list)
    logprob_top: int = 0
    # hybrid models: each sequence's KV pages in token order, covering start_pos + its new tokens
    # (a padded decode row, slot -1, has none)
    pages: list[list[int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_initial_state(self) -> list[bool]:
        # A sequence at position 0 starts from the zero state whatever its slot holds.
        return [p > 0 for p in self.start_pos]

    def snap_slots(self) -> list[int]:
        """Per sequence: its snapshot slot, or -1."""
        out = [-1] * self.batch_size
        for i, slot, *_ in self.snap:
            out[i] = slot
        return out

    def snap_lens(self) -> list[int]:
        """Per sequence: how many of this step's tokens its snapshot covers (all but the last unless a position
        is given; the same for a sequence without one, whose value nothing reads)."""
        out = [n - 1 for n in self.seq_lens]
        for i, _, *at in self.snap:
            if at:
                out[i] = at[0] - self.start_pos[i]
        return out

    def snap_tokens(self, i: int, prompt: list[int]) -> list[int]:
        """The tokens the snapshot of sequence ``i`` (whose whole prompt is ``prompt``) holds the state of."""
        _, _, *at = next(e for e in self.snap if e[0] == i)
        return prompt[:at[0]] if at else prompt[:-1]

    def kv_view(self, page_size: int) -> tuple[list[int], list[int], list[int]]:
        """(hybrids) The paged KV cache's view of the batch: each token's absolute position (RoPE) and cache
        slot (token ``p`` of a sequence goes to ``pages[p // page_size] * page_size + p % page_size``; -1: a
        padding row, which writes nothing), and each sequence's KV length after the step (0 for padding:
        it attends to nothing)."""
        pages = self.pages or [[] for _ in self.seq_lens]
        positions: list[int] = []
        slots: list[int] = []
        kv_lens: list[int] = []
        for start, n, own, slot in zip(self.start_pos, self.seq_lens, pages, self.slots):
            if slot < 0 or not own:
                positions += [0] * n
                slots += [-1] * n
                kv_lens.append(0)
                continue
            if len(own) * page_size < start + n:
                raise ValueError(f"a sequence of {start + n} tokens has only {len(own)} pages of {page_size}")
            positions += range(start, start + n)
            # whole pages at once: the slots of a page's tokens are consecutive
            p = start
            while p < start + n:
                page, off = divmod(p, page_size)
                m = min(page_size - off, start + n - p)
                base = own[page] * page_size + off
                slots += range(base, base + m)
                p += m
            kv_lens.append(start + n)
        return positions, slots, kv_lens


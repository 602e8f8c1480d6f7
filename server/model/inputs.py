"""What the model's forward takes besides token ids: the step's mode and its batch as device tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunks: packed variable-length sequences
    DECODE = "decode"  # one token per running request


@dataclass
class BatchTensors:
    """A step's sequences as device tensors (built once per step by the engine's model runner)."""

    mode: ForwardMode
    cu_seqlens: torch.Tensor  # [S+1]
    slots: torch.Tensor  # [S]
    has_initial_state: torch.Tensor  # [S]
    start_pos: torch.Tensor  # [S]
    # tracked states to capture: (sequence index, absolute position), positions multiples of chunk_size
    track: list[tuple[int, int]] = field(default_factory=list)
    # [S] where each sequence's state before its last token goes (-1: nowhere); None: no snapshots
    snap_slots: torch.Tensor | None = None
    snap_len: torch.Tensor | None = None  # [S] tokens of this step each snapshot covers (None: all but the last)
    host_cu: list[int] = field(default_factory=list)
    host_start: list[int] = field(default_factory=list)
    # attention layers of hybrid models (None for pure Mamba2): the paged KV cache's view of the batch
    positions: torch.Tensor | None = None  # [T] int64, absolute position of each token (RoPE)
    slot_mapping: torch.Tensor | None = None  # [T] int64, page * page_size + offset where its k/v go
    block_table: torch.Tensor | None = None  # [S, max_pages] int32, each sequence's pages in order
    kv_lens: torch.Tensor | None = None  # [S] int32, tokens in each sequence's pages after this step

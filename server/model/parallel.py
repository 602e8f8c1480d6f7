"""Tensor parallelism: which part of each weight and state a rank holds, and the collectives between ranks.

At ``--tensor-parallel-size N`` every rank (one process per device) runs the same forward on its shard of
every layer; the layers' outputs are summed across ranks (``TP.all_reduce``) where a row-parallel
projection ends a block, and the logits gathered (``TP.gather_vocab``). The shards:

- Mamba2 mixers by heads (``mamba_shard``): in_proj's z, x and dt rows of the rank's heads, its B and C rows of
  the groups those heads read (the one group, replicated on every rank, in a model that has one), the conv
  channels and A/D/dt_bias of the same, the gated norm's weight and out_proj's columns of the rank's channels.
  The gated norm is grouped (``d_inner / n_groups`` channels); where the one group spans the ranks, its mean
  square is summed with the output (``Mamba2Mixer._out_spanning``, ``kernels.split_gated_norm``);
- attention by heads (``attention_shard``): query heads split, KV heads split or, when fewer than N, the one
  each rank's query heads read replicated;
- MLPs column/row (their intermediate width split), MoE experts tensor-parallel within each expert (every
  rank holds every expert's slice of the intermediate width: the router and its choice are the same on every
  rank, no tokens move between ranks);
- embedding and LM head by vocabulary rows (``vocab_part``).

A row-parallel projection's bias is held by rank 0 alone (``FIRST``): the sum across ranks adds it once.

Weights are read per shard (``Slices``: ranges of one dimension), so a rank never holds a full copy of a
sharded tensor. The same index math gives the state pool's shards (``state_channels``): a state read out
for a file is gathered into the layout a single device holds, and a file's state is sliced per rank on
load, whatever the TP size that wrote it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mambaserve.server.model.config import Mamba2Dims, ModelLoadError


@dataclass(frozen=True)
class TP:
    """This process's place among the ranks of one model: ``rank`` of ``size``, the process group of the
    device collectives and one of host collectives (None at size 1, where every collective is the identity)."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    cpu_group: object | None = None

    def part(self, n: int, what: str) -> range:
        """This rank's even share of ``n`` (heads, channels, rows): ModelLoadError if ``n`` does not divide."""
        if n % self.size:
            raise ModelLoadError(f"--tensor-parallel-size {self.size} does not divide the model's {n} {what}")
        k = n // self.size
        return range(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (the ranks' partial outputs of a row-parallel projection)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Each value's largest over the ranks (host integers: what the ranks must agree on)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return t.tolist()

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[T, V/N]`` columns as ``[T, V]`` (vocabulary-parallel logits; every rank gets them,
        rank 0 samples)."""
        if self.size == 1:
            return x
        out = x.new_empty(self.size * x.shape[0], x.shape[1])
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)


SINGLE = TP()
# torch 2.13 renamed all_gather_into_tensor (deprecated since); the GPU images' 2.11 has only the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Slices:
    """A rank's part of a checkpoint tensor: the rows (or columns, ``dim``) in ``ranges``, concatenated;
    indices past the tensor's end read as zeros (a vocabulary padded to a multiple of the ranks)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(dim: int, *parts: range) -> "Slices":
        return Slices(dim, tuple((r.start, r.stop) for r in parts))

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


FIRST = "first"  # a row-parallel projection's bias: rank 0 holds it, the others zeros (the sum adds it once)


def shard_shape(shape: tuple[int, ...], spec: Slices | str | None) -> tuple[int, ...]:
    if not isinstance(spec, Slices):
        return tuple(shape)
    return tuple(spec.size if i == spec.dim else n for i, n in enumerate(shape))


# ---- Mamba2 --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MambaShard:
    """A rank's share of a Mamba2 mixer: ``local`` are the dims its modules and state pool have (heads and
    groups of this rank), ``heads`` and ``groups`` which of the full model's they are. ``norm_spans``: the
    gated norm's one group is wider than the rank's channels (``n_groups`` 1, ranks > 1)."""

    full: Mamba2Dims
    local: Mamba2Dims
    heads: range
    groups: range

    @property
    def norm_group_size(self) -> int:
        return self.full.d_inner // self.full.n_groups

    @property
    def norm_spans(self) -> bool:
        return self.norm_group_size > self.local.d_inner


def mamba_shard(d: Mamba2Dims, tp: TP) -> MambaShard:
    """Heads split evenly; a rank's B/C groups are those its heads read: ``n_groups / N`` of them when N divides
    the groups, else (one group) the group, replicated on every rank. Other combinations are refused: where N
    and the groups divide neither way a rank's heads would read groups held elsewhere; where several groups
    each span ranks, their norms would need a sum per group (not built)."""
    heads = tp.part(d.num_heads, "Mamba heads")
    G, N = d.n_groups, tp.size
    if G % N == 0:
        groups = tp.part(G, "Mamba groups")
    elif G == 1:  # every rank reads the one group; the gated norm over it is split (kernels.split_gated_norm)
        groups = range(0, 1)
    elif N % G == 0:
        raise ModelLoadError(f"--tensor-parallel-size {N} with the Mamba layers' {G} groups of B/C: each group's "
                             "gated norm would span several ranks; not built (fewer ranks, or one group, is)")
    else:
        raise ModelLoadError(f"--tensor-parallel-size {N} and the Mamba layers' {G} groups of B/C: neither "
                             "divides the other, so a rank's heads would read groups held elsewhere")
    local = dataclasses.replace(d, num_heads=len(heads), n_groups=len(groups))
    return MambaShard(d, local, heads, groups)


def _scaled(r: range, k: int, offset: int = 0) -> range:
    return range(offset + r.start * k, offset + r.stop * k)


def state_channels(s: MambaShard) -> tuple[range, range, range]:
    """The conv state's (and the conv weight's) channels of rank ``s``, as ranges of the full ``conv_dim``:
    its x channels, then its B and C groups."""
    d, n = s.full, s.full.state_size
    return (_scaled(s.heads, d.head_dim), _scaled(s.groups, n, d.d_inner),
            _scaled(s.groups, n, d.d_inner + d.n_groups * n))


def in_proj_rows(s: MambaShard) -> tuple[range, ...]:
    """in_proj's output rows of rank ``s``: z, then x/B/C (the conv channels), then dt, in the full layout
    ``[z: d_inner | x: d_inner | B | C | dt: H]``."""
    d = s.full
    conv = tuple(range(r.start + d.d_inner, r.stop + d.d_inner) for r in state_channels(s))
    dt = range(2 * d.d_inner + 2 * d.n_groups * d.state_size + s.heads.start,
               2 * d.d_inner + 2 * d.n_groups * d.state_size + s.heads.stop)
    return (_scaled(s.heads, d.head_dim), *conv, dt)


def _channel_index(s: MambaShard) -> torch.Tensor:
    return torch.cat([torch.arange(r.start, r.stop) for r in state_channels(s)])


def slot_shapes(full: Mamba2Dims) -> dict[str, tuple[int, ...]]:
    """One slot's state, every Mamba layer, in one device's layout: what files and the host tier hold."""
    return {"conv": (full.num_layers, full.conv_dim, full.conv_kernel - 1),
            "ssm": (full.num_layers, full.num_heads, full.head_dim, full.state_size)}


def shard_state(state: dict[str, torch.Tensor], full: Mamba2Dims, size: int) -> list[dict[str, torch.Tensor]]:
    """One slot's state in the layout a single device holds (``conv [L, conv_dim, K-1]``, ``ssm [L, H, P, N]``)
    as each of ``size`` ranks holds it: its conv channels and heads (``mamba_shard``)."""
    out = []
    for rank in range(size):
        s = mamba_shard(full, TP(rank, size))
        out.append({"conv": state["conv"][:, _channel_index(s).to(state["conv"].device)].contiguous(),
                    "ssm": state["ssm"][:, s.heads.start:s.heads.stop].contiguous()})
    return out


def merge_state(shards: list[dict[str, torch.Tensor]], full: Mamba2Dims) -> dict[str, torch.Tensor]:
    """The inverse of ``shard_state``: the ranks' parts of one slot's state in a single device's layout (groups
    replicated on several ranks are the same values on each: the last one's is kept)."""
    size, c0, s0 = len(shards), shards[0]["conv"], shards[0]["ssm"]
    conv = c0.new_empty(c0.shape[0], full.conv_dim, c0.shape[2])
    ssm = s0.new_empty(s0.shape[0], full.num_heads, *s0.shape[2:])
    for rank, part in enumerate(shards):
        s = mamba_shard(full, TP(rank, size))
        conv[:, _channel_index(s).to(conv.device)] = part["conv"]
        ssm[:, s.heads.start:s.heads.stop] = part["ssm"]
    return {"conv": conv, "ssm": ssm}


def mamba_slices(s: MambaShard, bias: bool, conv_bias: bool) -> dict[str, Slices | str | None]:
    """Each Mamba2Mixer parameter's part on rank ``s`` (names relative to the mixer)."""
    d = s.full
    heads = Slices.of(0, s.heads)
    channels = Slices.of(0, _scaled(s.heads, d.head_dim))
    out = {"in_proj.weight": Slices.of(0, *in_proj_rows(s)), "conv1d.weight": Slices.of(0, *state_channels(s)),
           "dt_bias": heads, "A_log": heads, "D": heads, "norm.weight": channels,
           "out_proj.weight": Slices.of(1, _scaled(s.heads, d.head_dim))}
    if bias:
        out["in_proj.bias"] = Slices.of(0, *in_proj_rows(s))
        # added after the norm's scale where the norm spans ranks: every rank then adds it after the sum
        out["out_proj.bias"] = None if s.norm_spans else FIRST
    if conv_bias:
        out["conv1d.bias"] = Slices.of(0, *state_channels(s))
    return out


# ---- attention, MLPs, experts, vocabulary ---------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShard:
    heads: range  # query heads
    kv_heads: range


def attention_shard(num_heads: int, num_kv_heads: int, tp: TP) -> AttentionShard:
    """Query heads split evenly; KV heads split too when N divides them, else the one KV head the rank's query
    heads read (N a multiple of the KV heads), replicated on the ranks sharing it."""
    heads = tp.part(num_heads, "attention heads")
    if num_kv_heads % tp.size == 0:
        kv = tp.part(num_kv_heads, "KV heads")
    elif tp.size % num_kv_heads == 0:
        h = tp.rank // (tp.size // num_kv_heads)
        kv = range(h, h + 1)
    else:
        raise ModelLoadError(f"--tensor-parallel-size {tp.size} and the model's {num_kv_heads} KV heads: neither "
                             "divides the other")
    return AttentionShard(heads, kv)


def column(tp: TP, n: int, what: str, dim: int = 0) -> Slices:
    """A column-parallel projection's rows (its output features): this rank's even share."""
    return Slices.of(dim, tp.part(n, what))


def gated_column(tp: TP, n: int, what: str, dim: int = 0) -> Slices:
    """Gate and up projections stored in one tensor (gate rows first): this rank's share of each."""
    r = tp.part(n, what)
    return Slices.of(dim, r, range(n + r.start, n + r.stop))


def vocab_part(vocab: int, tp: TP) -> range:
    """This rank's vocabulary rows: the vocabulary padded to a multiple of the ranks, split evenly."""
    return tp.part(-(-vocab // tp.size) * tp.size, "vocabulary rows")


def embed(ids: torch.Tensor, weight: torch.Tensor, rows: range, tp: TP) -> torch.Tensor:
    """A vocabulary-parallel embedding lookup: each rank looks up the ids in its rows (zeros for the others'),
    the sum over ranks is every id's row."""
    if tp.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    local = ids - rows.start
    mine = (local >= 0) & (local < len(rows))
    x = torch.nn.functional.embedding(local.clamp(0, len(rows) - 1), weight) * mine[:, None].to(weight.dtype)
    return tp.all_reduce(x)

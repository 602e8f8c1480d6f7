"""Which implementation a launcher runs: the Triton kernel or the pure-torch reference.

Rules, in order:
  1. ``force_triton=True`` runs Triton whatever the device; on CPU tensors that needs the Triton
     interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is first imported), which is how the
     tests run the kernels without a GPU. ``force_triton=False`` runs the reference.
  2. ``MAMBASERVE_KERNELS=ref`` in the environment runs the references everywhere (debugging, A/B).
  3. Otherwise Triton on CUDA tensors, the reference on CPU tensors.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:  # Triton is an optional dependency (the ``triton`` extra); CPU-only installs run references.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    try:  # griddepcontrol (programmatic dependent launch), Triton >= 3.3
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover
        gdc_launch_dependents = gdc_wait = None
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False
    gdc_launch_dependents = gdc_wait = None


if HAS_TRITON:

    @triton.jit
    def softplus(x):
        """torch's softplus (threshold 20); exp(x) where log(1 + exp(x)) would round to 0 in fp32."""
        return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))

    @triton.jit
    def dt_prologue(dt, bias_ptr, lo, hi, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr):
        """The torch ``process_dt`` of ``ssd_scan`` on fp32 ``dt``: ``+ bias`` (the scalar at ``bias_ptr``),
        softplus, clamp to ``[lo, hi]``, each step only when asked."""
        if HAS_BIAS:
            dt += tl.load(bias_ptr).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, lo), hi)
        return dt

    @triton.jit
    def locate_block(pid, cu_ptr, pos_ptr, S, Q, HAS_POS: tl.constexpr, BLOCK_S: tl.constexpr):
        """Block ``pid`` of packed sequences cut at multiples of ``Q`` of absolute position.

        Sequence ``s`` holds tokens ``cu[s]:cu[s+1]`` at absolute positions ``pos[s] + i``; its blocks
        are numbered after those of sequences ``< s``. Returns ``(seq, j, tok0, tok1)``: the block is
        packed tokens ``[tok0, tok1)`` and is block ``j`` of sequence ``seq``. Past the last block,
        ``seq == S`` and ``tok1 == tok0``, so every masked access is empty. Launch an upper bound of
        ``T // Q + 2 * S`` programs: no host needs to know the real count.
        """
        s_idx = tl.arange(0, BLOCK_S)
        ms = s_idx < S
        beg = tl.load(cu_ptr + s_idx, mask=ms, other=0).to(tl.int32)
        end = tl.load(cu_ptr + s_idx + 1, mask=ms, other=0).to(tl.int32)
        if HAS_POS:
            off = (tl.load(pos_ptr + s_idx, mask=ms, other=0) % Q).to(tl.int32)
        else:
            off = tl.zeros([BLOCK_S], dtype=tl.int32)
        L = end - beg
        nblk = tl.where(L > 0, (off + L + Q - 1) // Q, 0)
        incl = tl.cumsum(nblk, 0)
        seq = tl.sum((incl <= pid).to(tl.int32), 0)
        sel = s_idx == seq
        first = tl.sum(tl.where(sel, incl - nblk, 0), 0)
        b0 = tl.sum(tl.where(sel, beg, 0), 0)
        L0 = tl.sum(tl.where(sel, L, 0), 0)
        off0 = tl.sum(tl.where(sel, off, 0), 0)
        j = pid - first
        tok0 = b0 + tl.maximum(j * Q - off0, 0)
        tok1 = b0 + tl.minimum((j + 1) * Q - off0, L0)
        tok1 = tl.where(seq < S, tok1, tok0)
        return seq, j, tok0, tok1

    @triton.jit
    def pdl_start(USE_PDL: tl.constexpr):
        """Programmatic dependent launch, called first thing: let the next kernel in the stream start
        launching now (its programs wait here in turn), then wait until the previous kernel has
        finished and its writes are visible. Only the launch latency overlaps; no read moves before
        the wait, so any kernel order stays correct. Kernels that do work in between call the two halves,
        ``pdl_trigger`` and ``pdl_wait``: the projections' ``prefetch_l2``, the state update's read of
        its own state and in_proj's conv-step reads (safe for the reason the state update's docstring gives)."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)

    @triton.jit
    def pdl_trigger(USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_wait()

    @triton.jit
    def prefetch_l2(ptrs):
        """Ask L2 to fetch the lines holding ``ptrs`` (valid addresses; one per 128-byte line is enough)
        without waiting for them. A hint that reads no value into registers, and L2 is where every
        SM's writes land, so it is safe before ``pdl_wait``: a decode projection starts streaming its
        weights into L2 while the kernel before it still runs (PTX, GPU only)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_rows(w_ptr, rows, n_rows, row_stride, row_len, LINES: tl.constexpr):
        """``prefetch_l2`` of the first ``LINES`` 128-byte lines of rows ``rows`` (clamped below ``n_rows``) of a
        matrix at ``w_ptr``, ``row_len`` elements a row and ``row_stride`` apart: a projection's weight rows, asked of
        L2 before the program's PDL wait."""
        line = tl.arange(0, LINES) * (1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
        prefetch_l2(w_ptr + tl.minimum(rows, n_rows - 1)[:, None] * row_stride
                    + tl.minimum(line, row_len - 1)[None, :])

else:  # pragma: no cover
    softplus = None
    dt_prologue = None
    locate_block = None
    pdl_start = pdl_trigger = pdl_wait = prefetch_l2 = prefetch_rows = None


def prefetch_lines(elements: int, element_size: int) -> int:
    """``prefetch_rows``' LINES for the first ``elements`` of each row: 128-byte lines, a power of two."""
    return next_pow2(-(-elements * element_size // 128))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Target:
    """What a launcher chooses its variant by besides the shapes: compiled kernels (their GPU tiles and
    matrix-unit operand types; False: the interpreter's), the GPU's streaming multiprocessors, Hopper features
    (TMA tensor descriptors) and programmatic dependent launch."""

    compiled: bool
    sms: int = 1
    hopper: bool = False
    pdl: bool = False


H100 = Target(compiled=True, sms=132, hopper=True, pdl=True)
_INTERPRETER = Target(compiled=False)
_emulated: list[Target] = []  # kernels.variants.dry_run: launchers choose as on this target, and launch nothing


def target(t: torch.Tensor) -> Target:
    """The target launches for tensors where ``t`` lives are chosen for."""
    if _emulated:
        return _emulated[-1]
    if not t.is_cuda or interpreting():
        return _INTERPRETER
    return _cuda_target(_index(t.device), os.environ.get("MAMBASERVE_PDL", "1") != "0")


@functools.cache
def _cuda_target(index: int, pdl_allowed: bool) -> Target:
    hopper = torch.cuda.get_device_capability(index)[0] >= 9
    return Target(compiled=True, sms=torch.cuda.get_device_properties(index).multi_processor_count, hopper=hopper,
                  pdl=pdl_allowed and hopper and gdc_wait is not None)


def use_triton(t: torch.Tensor, force_triton: bool | None) -> bool:
    """True when the launcher should run its Triton kernel for tensors living where ``t`` lives."""
    if force_triton is not None:
        if force_triton:
            if not HAS_TRITON:
                raise RuntimeError("force_triton=True but triton is not installed")
            if not t.is_cuda and not interpreting() and not _emulated:
                raise RuntimeError("force_triton=True on CPU tensors needs TRITON_INTERPRET=1 set before "
                                   "triton is imported")
        return force_triton
    if os.environ.get("MAMBASERVE_KERNELS", "").lower() == "ref":
        return False
    return HAS_TRITON and (t.is_cuda or bool(_emulated))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes the grids that must fill the GPU)."""
    return _cuda_target(_index(device), True).sms


def use_pdl(t: torch.Tensor) -> bool:
    """Launch decode kernels with programmatic dependent launch: CUDA on Hopper or newer, a Triton
    with griddepcontrol, not the interpreter; ``MAMBASERVE_PDL=0`` turns it off (A/B, debugging)."""
    return target(t).pdl


def tma_descriptor(t: torch.Tensor, rows: int, cols: int, row_stride: int, block: list[int]):
    """A 2-D TMA tensor descriptor [rows, cols] over ``t``'s storage (columns contiguous), or None where
    the layout does not allow one (16-byte aligned base and row stride) or TMA is unavailable. Loads through
    it read zeros past the bounds."""
    tg = target(t)
    if not HAS_TRITON or not (tg.hopper if tg.compiled else interpreting()):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - Triton < 3.4
        return None
    if t.data_ptr() % 16 or (row_stride * t.element_size()) % 16 or block[-1] * t.element_size() < 16:
        return None
    return TensorDescriptor(t, [rows, cols], [row_stride, 1], block)


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that calls ``pdl_start``: PDL on where ``use_pdl`` says so."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(t) else {}


def seq_block(S: int) -> int:
    """Width of the per-sequence vectors of the varlen kernels (``locate_block``'s BLOCK_S). A compile-time
    constant, so each value is a compile: one variant up to 32 sequences in a batch, then one per power
    of two (``server/engine/warm_up.py`` compiles them all at start)."""
    return max(32, next_pow2(S))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()

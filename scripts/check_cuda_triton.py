"""What a server image must be able to do on a GPU node, checked inside it (scripts/check_server_image.sh):
torch sees CUDA, and Triton compiles and runs a kernel. Triton builds a small C launcher with the system
C compiler the first time a kernel runs, so an image without one fails here, not on a request.
Prints one line per check; exits non-zero on the first failure."""

from __future__ import annotations

import shutil
import sys


def main() -> int:
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device (is the pod/container given a GPU?)")
        return 1
    print(f"device: {torch.cuda.get_device_name(0)}; C compiler: {shutil.which('cc') or shutil.which('gcc')}")
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out + offsets, tl.load(x + offsets, mask=mask) + tl.load(y + offsets, mask=mask), mask=mask)

    x, y = torch.randn(4099, device="cuda"), torch.randn(4099, device="cuda")
    out = torch.empty_like(x)
    add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    if not torch.equal(out, x + y):
        print("FAIL: the Triton kernel's result differs from torch's")
        return 1
    print(f"triton {triton.__version__}: compiled and ran a kernel, result equal to torch's")
    from mambaserve.kernels import decode_runs_triton  # noqa: F401  the package's kernels import
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Triton kernels against their references on the current device, over a grid of small and odd shapes.

Prints the max abs difference per op and shape (fp32). Used to find shape classes a compiled kernel
gets wrong that the CPU interpreter does not (e.g. tiles below the tensor-core minimum).

  python scripts/check_kernels_gpu.py
"""

import importlib

import torch

ops = {m: importlib.import_module(f"mambaserve.kernels.{m}") for m in
       ("ssd_scan", "selective_state_update", "conv1d", "gated_rmsnorm")}
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False


def diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def check(H, P, G, N, Q, K=4):
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    lens = [5, 37, 16, 70]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots = torch.tensor([1, 2, 3, 4], device=dev)
    hi = torch.tensor([False, True, False, True], device=dev)
    st = torch.tensor([0, 3, 0, 20], device=dev)
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N
    # the model's layout: x, B, C are column slices of one [T, conv_dim] tensor
    xBC = r(T, conv_dim)
    x = xBC[:, :d_inner].reshape(T, H, P)
    B = xBC[:, d_inner:d_inner + G * N].reshape(T, G, N)
    C = xBC[:, d_inner + G * N:].reshape(T, G, N)
    zdt = r(T, d_inner + H)
    dt = zdt[:, d_inner:]
    A, D, dtb = -torch.rand(H, generator=g).to(dev) - 0.1, r(H), r(H)
    res = {}
    init = r(6, H, P, N)
    outs = []
    for force in (False, True):
        pool = init.clone()
        y, _ = ops["ssd_scan"].ssd_scan_varlen(x, dt, A, B, C, chunk_size=Q, cu_seqlens=cu, ssm_state=pool,
                                               state_indices=slots, has_initial_state=hi, seq_start_pos=st, D=D,
                                               dt_bias=dtb, force_triton=force)
        outs.append((y, pool))
    res["scan"] = max(diff(outs[0][0], outs[1][0]), diff(outs[0][1], outs[1][1]))
    w, b = r(conv_dim, K), r(conv_dim)
    cinit = r(6, conv_dim, K - 1)
    outs = []
    for force in (False, True):
        cp = cinit.clone()
        outs.append((ops["conv1d"].causal_conv1d_varlen(xBC, w, b, cp, cu, slots, hi, force_triton=force), cp))
    res["conv"] = max(diff(outs[0][0], outs[1][0]), diff(outs[0][1], outs[1][1]))
    outs = []
    for force in (False, True):
        cp = cinit.clone()
        outs.append((ops["conv1d"].causal_conv1d_update(xBC[:4], cp, w, b, slots, force_triton=force), cp))
    res["conv_upd"] = max(diff(outs[0][0], outs[1][0]), diff(outs[0][1], outs[1][1]))
    outs = []
    for force in (False, True):
        pool = init.clone()
        outs.append((ops["selective_state_update"].selective_state_update(
            pool, x[:4], dt[:4], A, B[:4], C[:4], D, None, dtb, state_indices=slots, force_triton=force), pool))
    res["ssu"] = max(diff(outs[0][0], outs[1][0]), diff(outs[0][1], outs[1][1]))
    z = zdt[:, :d_inner]
    xn = r(T, d_inner)
    w_n = r(d_inner)
    res["norm"] = diff(ops["gated_rmsnorm"].gated_rmsnorm(xn, z, w_n, 1e-5, d_inner // G, force_triton=True),
                       ops["gated_rmsnorm"].gated_rmsnorm_ref(xn, z, w_n, 1e-5, d_inner // G))
    return res


for shape in [(8, 4, 2, 6, 16), (6, 8, 1, 8, 8), (8, 16, 2, 16, 16), (4, 32, 1, 32, 32), (24, 64, 1, 128, 256),
              (8, 64, 8, 128, 64)]:
    print(f"H={shape[0]:3} P={shape[1]:3} G={shape[2]} N={shape[3]:3} Q={shape[4]:3}",
          "  ".join(f"{k}={v:.2e}" for k, v in check(*shape).items()), flush=True)

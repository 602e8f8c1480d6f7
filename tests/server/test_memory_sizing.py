"""The state pool sized from memory: the arithmetic (engine/memory.py) at real model shapes, and the
engine refusing, in one line with the numbers, what cannot fit."""

import pytest
import torch

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.memory import GiB, plan_pool, reserve_bytes, slot_bytes
from tests.server.conftest import make_engine

# (layers, d_inner, heads, head dim, state, vocab) of state-spaces/mamba2-2.7b and -130m (n_groups 1, conv 4)
SHAPES = {"2.7b": (64, 5120, 80, 64, 128, 50288), "130m": (24, 1536, 24, 64, 128, 50288)}


def _plan(size, total_gib=79.2, weights_gib=None, **kw):
    layers, d_inner, heads, hd, n, vocab = SHAPES[size]
    per = slot_bytes(layers, d_inner + 2 * n, 4, heads, hd, n, torch.bfloat16, torch.float32)
    reserve = reserve_bytes(2 * d_inner + 2 * n + heads, heads, hd, n, vocab, 2048, 256, torch.bfloat16, True)
    in_use = int((weights_gib if weights_gib is not None else 1.0) * GiB)
    args = dict(total=int(total_gib * GiB), in_use=in_use, fraction=0.88, per_slot=per, reserve=reserve, slots=None,
                running=None, default_running=256) | kw
    return plan_pool(**args), per, reserve, args


def test_a_27b_model_serves_hundreds_of_slots_on_one_80gb_gpu_with_defaults():
    plan, per, reserve, a = _plan("2.7b", weights_gib=6.5)  # bf16 weights + CUDA context
    assert 300 <= plan.slots <= 400 and plan.max_running == 256
    assert plan.slots * per + reserve + a["in_use"] <= 0.88 * a["total"]  # within the fraction
    assert 150 * 2**20 < per < 175 * 2**20  # ~162 MiB: 64 layers of an fp32 80x64x128 state, the conv window


def test_a_small_model_is_capped_at_four_slots_per_running_request():
    plan, _, _, _ = _plan("130m")
    assert plan.slots == 4 * 256 and plan.max_running == 256


def test_explicit_sizes_that_do_not_fit_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"--mamba-cache-size 1024 needs .* GiB .* at most \d+ slots"):
        _plan("2.7b", weights_gib=6.5, slots=1024)
    assert _plan("2.7b", weights_gib=6.5, slots=200, running=300)[0].max_running == 200  # one slot each
    with pytest.raises(ValueError, match="raise --mem-fraction-static"):
        _plan("2.7b", total_gib=8, weights_gib=6.5)
    plan, _, _, _ = _plan("2.7b", weights_gib=6.5, slots=100)
    assert plan.slots == 100 and plan.max_running == 75  # three quarters: room for the cache and sessions


def test_the_pool_matches_the_arithmetic_and_a_pool_too_large_is_refused_before_allocating(tiny_ckpt):
    engine = make_engine(tiny_ckpt, mamba_cache_size=None, max_running_requests=None)
    assert engine.pool.bytes_per_slot == slot_bytes(
        engine.dims.num_layers, engine.dims.conv_dim, engine.dims.conv_kernel, engine.dims.num_heads,
        engine.dims.head_dim, engine.dims.state_size, engine.dtype, torch.float32)
    assert engine.pool.allocator.capacity == 4 * 64 and engine.max_running == 64  # CPU defaults, a tiny model
    with pytest.raises(ValueError, match=r"--mamba-cache-size 1000000000 needs"):
        make_engine(tiny_ckpt, mamba_cache_size=10**9)
    with pytest.raises(ValueError, match=r"--mem-fraction-static must be in \(0, 1\]"):
        ServerConfig(model=str(tiny_ckpt), mem_fraction_static=1.5)


def test_cpu_memory_in_use_leaves_out_the_reclaimable_page_cache():
    """Free pages alone count the page cache as used: after an image build filled it, an idle
    machine looked full and `mambaserve serve` on the CPU refused to start."""
    from mambaserve.server.engine.memory import device_memory

    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    total, in_use = device_memory(torch.device("cpu"))
    assert abs((total - in_use) - available) < 512 * 2**20  # what else runs may move it a little


def test_cpu_memory_is_the_containers_limit_when_it_has_one(tmp_path):
    """A CPU pod's memory limit (the operator sets one) bounds the state pool: sized from the node's RAM,
    the pool would outgrow the limit and the pod would be OOM-killed."""
    from mambaserve.server.engine.memory import cgroup_memory

    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text(str(3 * 2**30) + "\n")
    (tmp_path / "memory.stat").write_text("anon 1073741824\ninactive_file 1073741824\n")
    assert cgroup_memory(str(tmp_path)) == (8 * 2**30, 2 * 2**30)
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1073741824\n")
    (v1 / "memory" / "memory.stat").write_text("cache 0\ntotal_inactive_file 0\n")
    assert cgroup_memory(str(v1)) == (4 * 2**30, 2**30)

"""kernels.compiles: Triton's compile notifications reach the listeners (with the kernel's name, its
specialization key and the time between the two hooks), hooks installed before keep running, and the
compile cache directory is set where Triton reads it."""

import os

import pytest

pytest.importorskip("triton")

from mambaserve.kernels import compiles  # noqa: E402
from tests.kernels.helpers import triton_compile_hooks  # noqa: E402


def test_listeners_hear_each_compile_with_its_kernel_and_key_until_they_stop():
    assert compiles.hooks() == "knobs"  # Triton >= 3.4 here (3.9); the GPU machine's 3.6 too
    heard = []
    stop = compiles.watch(heard.append)
    try:
        triton_compile_hooks("key-a")
    finally:
        stop()
    triton_compile_hooks("key-b")  # stopped: not heard
    assert [(e.kernel, e.key) for e in heard] == [("_probe_kernel", "key-a")]
    assert heard[0].seconds is not None and 0 <= heard[0].seconds < 5


def test_hooks_installed_before_still_run_and_decide_whether_to_compile(monkeypatch):
    from triton import knobs

    compiles.hooks()  # ours are in place
    seen = []
    ours_before, ours_after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    # someone else's hooks, installed first: ours wrap them (as compiles._install does at its first use)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook",
                        compiles._before(lambda **kw: seen.append(("before", kw["key"])) or True))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        compiles._after(lambda **kw: seen.append(("after", kw["key"]))))
    heard = []
    stop = compiles.watch(heard.append)
    try:
        assert triton_compile_hooks("key-k") is True  # the earlier hook's "skip this compile" is passed on
    finally:
        stop()
    assert seen == [("before", "key-k"), ("after", "key-k")] and [e.key for e in heard] == ["key-k"]
    assert ours_before is not None and ours_after is not None


def test_a_failing_listener_does_not_fail_the_compile(caplog):
    def broken(event):
        raise RuntimeError("listener bug")

    stop = compiles.watch(broken)
    try:
        triton_compile_hooks("key-2")  # no exception reaches Triton
    finally:
        stop()
    assert "a kernel-compile listener failed" in caplog.text


def test_the_cache_directory_is_created_and_set_where_triton_reads_it(tmp_path, monkeypatch):
    from triton import knobs

    # both restored after the test; the knob read first: with the variable set to "" Triton's cache dir reads "", and
    # restored so, the next compile in the process (a GPU test) found no cache directory
    monkeypatch.setattr(knobs.cache, "dir", knobs.cache.dir)
    monkeypatch.setenv("TRITON_CACHE_DIR", knobs.cache.dir)
    path = compiles.set_cache_dir(tmp_path / "a" / "kernels")
    assert path.is_dir() and os.environ["TRITON_CACHE_DIR"] == str(path) and knobs.cache.dir == str(path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--kernel-cache-dir"):
        compiles.set_cache_dir(tmp_path / "file" / "kernels")

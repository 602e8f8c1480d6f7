"""The storage tier of hybrid models: an entry holds a Mamba snapshot and the KV of its tokens together, under one
compatibility key. A new server on the directory finds a prefix there, lands its KV in its tree's pages and its
state in the host tier, and answers as a cold engine does; an entry damaged (in its state or its KV) or written
by another model is refused and counted, never served."""

from __future__ import annotations

from mambaserve.server.cache import storage_entry as fmt
from tests.server.conftest import accounting, make_engine, run, serving
from tests.server.test_storage_tier import _entries, _metric

GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompt(n, seed):
    return [(seed * 29 + 5 * k * k + 3 * k) % 90 + 3 for k in range(n)]


PROMPTS = [_prompt(21, 1), _prompt(26, 2)]


def _engine(ckpt, root, **kw):
    return make_engine(ckpt, storage_dir=str(root), page_size=4, cache_prefetch_policy="wait_complete", **kw)


async def _serve(engine, prompts):
    async with serving(engine) as c:
        outs = []
        for p in prompts:
            r = await c.post("/generate", json={"input_ids": p, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 5, **GREEDY}})
            assert r.status_code == 200, r.text
            b = r.json()
            outs.append((b["output_ids"], b["meta_info"]["cached_tokens"]))
        if engine.scheduler.storage is not None:
            await engine.run_in_scheduler(engine.scheduler.storage.drain)
        metrics = (await c.get("/metrics")).text
        acc = await accounting(engine)
    return outs, metrics, acc


def test_a_new_server_serves_a_hybrid_prefix_from_storage(nemotron, tmp_path):
    first, _, acc = run(_serve(_engine(nemotron, tmp_path), PROMPTS))
    assert acc["storage_entries"] > 0
    header, _ = fmt.parse_header(_entries(tmp_path)[0].read_bytes())
    assert set(header["shapes"]) == {"conv", "ssm", "kv"} and header["compat"]["kv"][:1] == [2]  # 2 attention layers
    again, metrics, acc = run(_serve(_engine(nemotron, tmp_path), PROMPTS))
    cold, _, _ = run(_serve(make_engine(nemotron, disable_radix_cache=True), PROMPTS))
    assert [o for o, _ in again] == [o for o, _ in first] == [o for o, _ in cold]
    assert all(hit >= 16 for _, hit in again), again  # the prompts' last page boundaries, from the directory
    assert _metric(metrics, 'mambaserve_prefix_cache_hit_tokens_total{tier="storage"}') >= 32
    assert acc["kv_pages"] == acc["kv_pages_free"] + acc["kv_pages_tree"]


def test_hybrid_entries_damaged_or_of_another_model_are_refused(nemotron, tiny_ckpt, tmp_path):
    run(_serve(_engine(nemotron, tmp_path), PROMPTS[:1]))
    for path in _entries(tmp_path):  # a byte of each entry's KV (its last part) flipped
        data = bytearray(path.read_bytes())
        data[-fmt.CHECKSUM_BYTES - 3] ^= 0x40
        path.write_bytes(bytes(data))
    outs, metrics, _ = run(_serve(_engine(nemotron, tmp_path), PROMPTS[:1]))
    cold, _, _ = run(_serve(make_engine(nemotron, disable_radix_cache=True), PROMPTS[:1]))
    assert [o for o, _ in outs] == [o for o, _ in cold] and outs[0][1] == 0
    assert _metric(metrics, 'mambaserve_cache_storage_rejected_entries_total{reason="corrupt"}') >= 1

    # a Mamba2 model on the same directory: the hybrid's entries are another model's (left in place), and
    # the other way round
    mamba, _, _ = run(_serve(make_engine(tiny_ckpt, storage_dir=str(tmp_path), cache_prefetch_policy="wait_complete"),
                             PROMPTS[1:]))
    hybrid = _engine(nemotron, tmp_path)
    assert hybrid.metrics.storage_rejected.labels("incompatible")._value.get() >= 1
    outs, _, _ = run(_serve(hybrid, PROMPTS[1:]))
    cold, _, _ = run(_serve(make_engine(nemotron, disable_radix_cache=True), PROMPTS[1:]))
    assert [o for o, _ in outs] == [o for o, _ in cold] and outs[0][1] == 0
    kinds = {"kv" in fmt.parse_header(p.read_bytes())[0]["compat"] for p in _entries(tmp_path)}
    assert kinds == {True, False}  # both models' entries left in place

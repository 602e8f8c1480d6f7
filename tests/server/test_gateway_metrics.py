"""What an inference gateway routes by, read from a running tiny server's /metrics: queued and running
requests, state slots and KV pages (used / total / evictable), the pinned share of the fuller pool and the
cache-config info metric, for a pure Mamba2 and a hybrid model; and the EndpointPickerConfig in
docs/server-interface.md names only what the server exports."""

from __future__ import annotations

import asyncio
import pathlib
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from tests.server.conftest import accounting, make_engine, run, serving
from tests.server.tiny_hybrids import make_hybrid_checkpoint

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "server-interface.md"
LONG = {"temperature": 0, "ignore_eos": True}


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(text: str, name: str) -> float:
    (s,) = samples(text)[name]
    return s.value


async def scrape_while(c, predicate) -> str:
    """/metrics as soon as ``predicate`` holds for it (the scheduler updates gauges every step)."""
    for _ in range(2000):
        text = (await c.get("/metrics")).text
        if predicate(text):
            return text
        await asyncio.sleep(0.005)
    raise AssertionError(f"/metrics never matched; last:\n{text}")


def test_pure_mamba2_usage_is_the_pinned_share_of_the_slot_pool(tiny_ckpt):
    engine = make_engine(tiny_ckpt, context_length=8192)  # 8 slots, radix cache on

    async def go():
        async with serving(engine) as c:
            before = (await c.get("/metrics")).text
            task = asyncio.ensure_future(c.post("/generate", json={
                "input_ids": list(range(1, 13)), "rid": "long", "sampling_params": {"max_new_tokens": 5000, **LONG}}))
            busy = await scrape_while(c, lambda t: value(t, "mambaserve_num_running_requests") == 1)
            await c.post("/abort_request", json={"rid": "long"})
            await task
            await accounting(engine)
            idle = await scrape_while(c, lambda t: value(t, "mambaserve_num_running_requests") == 0)
            return before, busy, idle

    before, busy, idle = run(go())
    (info,) = samples(before)["mambaserve_cache_config_info"]
    assert info.value == 1 and info.labels == {"page_size": "1", "num_pages": "0", "num_state_slots": "8",
                                               "mamba_track_interval": "0"}
    assert value(before, "mambaserve_kv_pages_total") == 0 and value(before, "mambaserve_cache_usage_ratio") == 0
    # running: its slot is pinned; snapshots kept at chunk ends are evictable, so they count as free
    used, evictable = value(busy, "mambaserve_state_slots_used"), value(busy, "mambaserve_state_slots_evictable")
    assert value(busy, "mambaserve_cache_usage_ratio") == (used - evictable) / 8 == 1 / 8
    # finished: its state stays cached (a used slot) but nothing is pinned
    assert value(idle, "mambaserve_state_slots_used") >= 1
    assert value(idle, "mambaserve_state_slots_evictable") == value(idle, "mambaserve_state_slots_used")
    assert value(idle, "mambaserve_cache_usage_ratio") == 0


def test_hybrid_reports_kv_pages_and_the_fuller_pool(tmp_path):
    """One running request reserves 60 of 64 KV pages (prompt + max_new_tokens) and 1 of 1 state slots;
    a second one queues. Usage is the fuller pool's pinned share; all comes back after the abort. With the radix
    cache off no prompt counts as looked up in it (a hit rate of 0 would fire the chart's low-hit-rate alert)."""
    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h")
    engine = Engine(ServerConfig(model=str(path), device="cpu", disable_radix_cache=True, context_length=256,
                                 page_size=4, max_total_tokens=256, max_running_requests=2, mamba_cache_size=2,
                                 debug_cache_invariants=True))

    async def go():
        async with serving(engine) as c:
            before = (await c.get("/metrics")).text
            first = asyncio.ensure_future(c.post("/generate", json={
                "input_ids": list(range(1, 11)), "rid": "a", "sampling_params": {"max_new_tokens": 230, **LONG}}))
            await scrape_while(c, lambda t: value(t, "mambaserve_num_running_requests") == 1)
            second = asyncio.ensure_future(c.post("/generate", json={  # needs 2 pages more than are free
                "input_ids": list(range(1, 11)), "rid": "b", "sampling_params": {"max_new_tokens": 10, **LONG}}))
            busy = await scrape_while(c, lambda t: value(t, "mambaserve_num_waiting_requests") == 1)
            await c.post("/abort_request", json={"rid": "a"})
            await asyncio.gather(first, second)
            acc = await accounting(engine)
            idle = await scrape_while(c, lambda t: value(t, "mambaserve_kv_pages_used") == 0)
            return before, busy, idle, acc

    before, busy, idle, acc = run(go())
    (info,) = samples(before)["mambaserve_cache_config_info"]
    assert info.labels == {"page_size": "4", "num_pages": "64", "num_state_slots": "2", "mamba_track_interval": "0"}
    assert value(before, "mambaserve_kv_pages_total") == 64
    assert value(busy, "mambaserve_num_running_requests") == 1
    assert value(busy, "mambaserve_kv_pages_used") == 60 and value(busy, "mambaserve_kv_pages_evictable") == 0
    assert value(busy, "mambaserve_state_slots_used") == 1
    assert value(busy, "mambaserve_cache_usage_ratio") == 60 / 64  # the page pool, fuller than 1 of 2 slots
    assert value(idle, "mambaserve_cache_usage_ratio") == 0 and value(idle, "mambaserve_state_slots_used") == 0
    assert acc["kv_pages_free"] == acc["kv_pages"] == 64
    assert value(idle, "mambaserve_prefix_cache_queried_tokens_total") == 0


def _documented_epp_config() -> dict:
    text = DOC.read_text()
    section = text[text.index("### Inference gateways"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (extractor,) = [p for p in yaml.safe_load(block)["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert extractor["parameters"]["defaultEngine"] == engine["name"] == "mambaserve"
    return engine


def test_the_documented_gateway_config_names_exported_metrics(tiny_ckpt, tmp_path):
    """Every spec in the EndpointPickerConfig of docs/server-interface.md is a gauge both model kinds export,
    and the cache-info label names it gives are that metric's labels (with integer values)."""
    cfg = _documented_epp_config()
    specs = {k: v for k, v in cfg.items() if k.endswith("Spec") and v}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"}
    hybrid = Engine(ServerConfig(model=str(make_hybrid_checkpoint(tmp_path / "gm", "granite_moe")), device="cpu",
                                 disable_radix_cache=True, context_length=64, max_running_requests=2))

    async def scrape(engine):
        async with serving(engine) as c:
            return (await c.get("/metrics")).text

    for text in (run(scrape(make_engine(tiny_ckpt))), run(scrape(hybrid))):
        types = {f.name: f.type for f in text_string_to_metric_families(text)}
        for spec in specs.values():
            assert types.get(spec) == "gauge", (spec, types.get(spec))
        (info,) = samples(text)[specs["cacheInfoSpec"]]
        for label in (cfg["cacheBlockSizeLabelName"], cfg["cacheNumBlocksLabelName"]):
            assert info.labels[label].isdigit(), (label, info.labels)

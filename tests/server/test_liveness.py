"""Liveness from progress: ``/health?stuck_step_timeout=S`` fails while a step has run longer than S seconds
with requests pending (what a wedged GPU looks like), and an idle server stays live however long it idles."""

from __future__ import annotations

import asyncio
import threading

from tests.server.conftest import make_engine, run, serving


def test_a_stuck_step_fails_liveness_and_an_idle_server_does_not(tiny_ckpt):
    engine = make_engine(tiny_ckpt)
    release = threading.Event()
    forward = engine.scheduler.runner.forward

    def wedged(batch):  # the device never answers until released
        release.wait(30)
        return forward(batch)

    async def go():
        async with serving(engine) as c:
            await asyncio.sleep(1.2)  # idle for more than two inbox waits
            idle = await c.get("/health", params={"stuck_step_timeout": 0.05})
            assert (await c.get("/health")).text == "OK"

            engine.scheduler.runner.forward = wedged
            request = asyncio.create_task(c.post("/generate", json={"text": "hello", "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}}))
            await asyncio.sleep(0.6)
            stuck = await c.get("/health", params={"stuck_step_timeout": 0.3})
            readiness = await c.get("/health")  # without the parameter: the thread still runs
            patient = await c.get("/health", params={"stuck_step_timeout": 60})
            release.set()
            done = await request
            after = await c.get("/health", params={"stuck_step_timeout": 0.3})
            return idle, stuck, readiness, patient, done, after

    idle, stuck, readiness, patient, done, after = run(go())
    assert idle.status_code == 200 and idle.text.startswith("OK: ") and "0 requests pending" in idle.text, idle.text
    assert stuck.status_code == 503, stuck.text
    message = stuck.json()["error"]["message"]
    assert "stuck_step_timeout 0.3 s" in message and "1 requests pending" in message, message
    assert readiness.status_code == 200 and patient.status_code == 200
    assert done.status_code == 200
    assert after.status_code == 200, after.text

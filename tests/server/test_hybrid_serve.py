"""`mambaserve serve --model <hybrid checkpoint>` as a user starts it, with a storage tier and persisted sessions:
/generate answers transformers' greedy tokens (and the same prompt sent again hits the radix cache at its last page
boundary; the storage tier holds its entries), /get_model_info names the architecture."""

import time

import httpx
import torch

from tests.server.conftest import free_port
from tests.server.test_cli_serve import _serve
from tests.server.tiny_hybrids import make_hybrid_checkpoint


def test_serve_a_hybrid_checkpoint(tmp_path):
    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h")
    port = free_port()
    proc = _serve(path, port, "--device", "cpu", "--context-length", "256", "--storage-dir", str(tmp_path / "st"),
                  "--session-persist")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        prompt = list(range(11, 31))
        gen = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                         json={"input_ids": prompt, "sampling_params": params})
        again = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                           json={"input_ids": prompt, "sampling_params": params})
        # a streaming session of two turns with another request between them (it would reuse pages the
        # session gave up: freed pages go out first), then its history resent whole: the same answer
        sid = httpx.post(f"http://127.0.0.1:{port}/open_session", timeout=10, json={"streaming": True}).json()
        turns = []
        for new in ([40, 41, 42], [43, 44, 45, 46, 47]):
            turns.append(httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60, json={
                "input_ids": new, "sampling_params": params, "session_params": {"id": sid}}).json())
            httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                       json={"input_ids": list(range(60, 100)), "sampling_params": params})
        closed = httpx.post(f"http://127.0.0.1:{port}/close_session", timeout=10, json={"session_id": sid})
        history = [40, 41, 42] + turns[0]["output_ids"] + [43, 44, 45, 46, 47]
        resent = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                            json={"input_ids": history, "sampling_params": params}).json()
        info = httpx.get(f"http://127.0.0.1:{port}/get_model_info", timeout=10).json()
        server = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                      eos_token_id=None)[0, len(prompt):].tolist()
    assert gen.status_code == 200 and gen.json()["output_ids"] == ref
    assert again.json()["output_ids"] == ref and again.json()["meta_info"]["cached_tokens"] == 16
    assert closed.status_code == 200 and turns[1]["meta_info"]["cached_tokens"] == 9  # the live state: 3 + 6
    assert turns[1]["output_ids"] == resent["output_ids"]
    assert info["architecture"] == "NemotronHForCausalLM"
    state = server["internal_states"][0]
    # after /generate every page is free or the cache's, and the cache's may all be evicted
    assert server["page_size"] == 16 and state["kv_pages"] == state["kv_pages_free"] + state["kv_pages_tree"]
    assert state["kv_pages_tree"] == state["kv_pages_evictable"] > 0
    assert f"mambaserve_kv_pages_total {float(state['kv_pages'])}" in metrics
    assert f"mambaserve_kv_pages_evictable {float(state['kv_pages_evictable'])}" in metrics  # the cache's pages
    assert state["storage_entries"] > 0 and not state["storage_degraded"]

"""The tiny hybrid checkpoints the benchmarks build (benchmarks/e2e.py, reused by multiturn.py and
hit_profile.py) serve text over HTTP: their vocabulary holds every id of the tokenizer they ship (a tiny
Nemotron-H of 512 rows answered every text request with 400 "token ids out of range")."""

import importlib
import sys
from pathlib import Path

import httpx
import torch

from tests.server.conftest import make_engine, uvicorn_server

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_tiny_hybrid_built_by_the_benchmarks_answers_text_over_http(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other as their folder's modules
    e2e = importlib.import_module("e2e")
    e2e.build_hybrid_checkpoint("nemotron-tiny", tmp_path / "ckpt", "cpu", torch.float32)
    engine = make_engine(tmp_path / "ckpt", served_model_name="nemotron-tiny")
    prompt = "def fibonacci(n):"
    assert max(engine.encode(prompt)) >= e2e.HYBRIDS["nemotron-tiny"][1]["vocab_size"]  # past the shape's 512 rows
    engine.start()
    try:
        with uvicorn_server(engine) as url:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "nemotron-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "nemotron-tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
    finally:
        engine.stop()
        sys.modules.pop("e2e", None)
        sys.modules.pop("hybrid_step", None)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["text"] and r.json()["usage"]["completion_tokens"] == 8
    assert chat.status_code == 200, chat.text

"""The HTTP layer's own Python time per request and per streamed chunk (issue 28): what the event loop (and the
worker threads it hands tokenization to) spend while the scheduler thread, which shares the interpreter lock,
waits.

A real server (`mambaserve serve`, this process's code or a baseline commit's) on a CPU model; rounds of C chats
sent together to /v1/chat/completions, streamed, each a chat history of about --history tokens plus a new
question (the history repeats: radix cache hits); with --endpoint generate, token ids to /generate instead.
Each server thread's CPU time is read around the rounds (`pthread_getcpuclockid`): the event loop's (the main
thread), the worker threads' (tokenization, the chat template), the scheduler's. Two phases: --max-tokens 1
(a request's intake and one chunk) and --max-tokens N (N chunks): per chunk = (stream - intake) / (N - 1). With
--baseline REF the same is measured on commit REF's `server/` (extracted to a temporary directory) in the same run,
alternating, and the ratios are printed.
--profile PHASE prints cProfile's top functions of the event loop thread for that phase.

  python benchmarks/http_overhead.py --baseline main
  python benchmarks/http_overhead.py --profile intake --rounds 10
  python benchmarks/http_overhead.py --endpoint generate --baseline main   # token ids over /generate (multiturn.py's)
  python benchmarks/http_overhead.py --model /tmp/granite-tiny --baseline main    # (a GPU box: --device cuda)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "mamba2-tiny-pystdlib"


# ---- the server side (a child process: `--serve DIR -- serve flags`) ----------------------------------------------
def serve(out: Path, serve_args: list[str]) -> None:
    """``mambaserve serve`` in this process; SIGUSR1 writes every thread's CPU seconds to ``out/cpu-N.json``,
    SIGUSR2 starts cProfile on the main thread (the event loop) or, the second time, writes its stats."""
    import cProfile
    import threading

    from mambaserve.server import cli

    snaps, prof = [0], [None]

    def cpu_times(*_):
        times: dict[str, float] = {}
        for t in threading.enumerate():
            try:
                s = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, TypeError):  # ended meanwhile
                continue
            kind = "loop" if t is threading.main_thread() else "scheduler" if t.name == "scheduler" else (
                "workers" if t.name.startswith("asyncio_") else "other")
            times[kind] = times.get(kind, 0.0) + s
        snaps[0] += 1
        tmp = out / "cpu.tmp"
        tmp.write_text(json.dumps(times))
        tmp.rename(out / f"cpu-{snaps[0]}.json")

    def profile(*_):
        if prof[0] is None:
            prof[0] = cProfile.Profile()
            prof[0].enable()
        else:
            prof[0].disable()
            prof[0].dump_stats(out / "loop.prof")
            prof[0] = None
            (out / "prof.done").write_text("")

    signal.signal(signal.SIGUSR1, cpu_times)
    signal.signal(signal.SIGUSR2, profile)
    cli.main(serve_args)


# ---- the client side ---------------------------------------------------------------------------------------------
def baseline_tree(ref: str, into: Path) -> Path:
    """``ref``'s ``server/`` and ``kernels/`` as an importable ``mambaserve`` under ``into`` (for PYTHONPATH, which
    the editable install's finder comes after)."""
    pkg = into / "mambaserve"
    pkg.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "server", "kernels"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=tar, check=True)
    return into


def conversations(tokenizer_dir: Path, a: argparse.Namespace, answer: int) -> tuple[list[list[dict]], object]:
    """Each client's chat (a system message, then user / assistant turns of Python source text, what the bundled
    tokenizer knows), and ``piece(tokens)``: such text of about that many tokens. Each round adds a question and
    the answer (of ``answer`` tokens) to every chat (a multi-turn chat: its history is a cache hit); the chats
    start short enough that the rounds' mean history is about --history tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = "\n".join(p.read_text() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:40])
    rng = random.Random(a.seed)

    def piece(tokens: int) -> str:
        start = rng.randrange(0, len(text) - 20 * tokens)
        return tok.decode(tok.encode(text[start:start + 8 * tokens]).ids[:tokens])

    start = max(256, a.history - (a.rounds + 1) * (a.question + answer) // 2)
    chats = []
    for _ in range(a.clients):
        msgs = [{"role": "system", "content": "You are a helpful assistant that writes Python."}]
        turn = start // 6
        while sum(len(tok.encode(m["content"]).ids) for m in msgs) < start - turn:
            msgs.append({"role": "user" if len(msgs) % 2 else "assistant", "content": piece(turn)})
        if msgs[-1]["role"] == "user":
            msgs.append({"role": "assistant", "content": piece(turn // 2)})
        chats.append(msgs)
    return chats, piece


async def one_chat(session, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, int, int, str]:
    """Stream one chat completion; returns (seconds to the first chunk, chunks, prompt tokens, the answer)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    ttft, chunks, prompt, answer = None, 0, (0, 0), []
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt = (chunk["usage"]["prompt_tokens"], chunk["usage"]["prompt_tokens_details"]["cached_tokens"])
            else:
                chunks += 1
                answer.append(chunk["choices"][0]["delta"].get("content") or "")
    return ttft, chunks, prompt, "".join(answer)


async def one_generate(session, url: str, ids: list[int], max_tokens: int) -> tuple[float, int, tuple, list[int]]:
    """Stream one ``/generate`` of token ids (as ``multiturn.py`` sends them); the same tuple as ``one_chat``."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    t0 = time.perf_counter()
    ttft, chunks, last = None, 0, None
    async with session.post(url + "/generate", data=body, headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunks += 1
            last = json.loads(line[6:])
    meta = last["meta_info"]
    return ttft, chunks, (meta["prompt_tokens"], meta["cached_tokens"]), last["output_ids"]


class Server:
    def __init__(self, a: argparse.Namespace, pythonpath: Path | None, label: str):
        import httpx
        from _server import free_port, healthy  # (here: not in the server's own process, which runs this file)

        self.dir = Path(tempfile.mkdtemp(prefix=f"http-overhead-{label}-"))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + env.get("PYTHONPATH", "").split(os.pathsep))
        cmd = [sys.executable, __file__, "--serve", str(self.dir), "--", "serve", "--model", str(a.model),
               "--port", str(port), "--log-level", "warning", *a.server_args.split()]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        self.snaps = 0
        if not healthy(self.url, self.proc, 300):
            raise RuntimeError(f"server did not start: {' '.join(cmd)}")
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    async def cpu(self) -> dict[str, float]:
        self.snaps += 1
        path = self.dir / f"cpu-{self.snaps}.json"
        self.proc.send_signal(signal.SIGUSR1)
        while not path.exists():
            await asyncio.sleep(0.01)
        return json.loads(path.read_text())

    async def profile(self, start: bool) -> Path | None:
        self.proc.send_signal(signal.SIGUSR2)
        if start:
            return None
        while not (self.dir / "prof.done").exists():
            await asyncio.sleep(0.01)
        return self.dir / "loop.prof"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def phase(server: Server, a: argparse.Namespace, max_tokens: int, profile: bool) -> dict:
    """A round unmeasured (connections opened, histories cached), then --rounds rounds of every chat sent together;
    each thread kind's CPU ms per request, the TTFTs, chunks per request, the prompts' mean tokens."""
    import aiohttp

    rng = random.Random(a.seed)
    if a.endpoint == "generate":
        histories = [[rng.randrange(1, 4000) for _ in range(a.history)] for _ in range(a.clients)]
    else:
        chats, piece = conversations(a.model, a, max_tokens)
    ttfts, chunks, prompt_tokens = [], 0, []
    async with aiohttp.ClientSession() as s:
        async def round_() -> list[tuple[float, int, int, str]]:
            if a.endpoint == "generate":
                questions = [[rng.randrange(1, 4000) for _ in range(a.question)] for _ in histories]
                got = await asyncio.gather(*(one_generate(s, server.url, h + q, max_tokens)
                                             for h, q in zip(histories, questions)))
                for h, q, (_, _, _, answer) in zip(histories, questions, got):
                    h += q + answer
                return got
            questions = [piece(a.question) for _ in chats]
            got = await asyncio.gather(*(one_chat(s, server.url, server.model, c + [{"role": "user", "content": q}],
                                                  max_tokens) for c, q in zip(chats, questions)))
            for c, q, (_, _, _, answer) in zip(chats, questions, got):
                c += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
            return got

        await round_()
        if profile:
            await server.profile(start=True)
        before = await server.cpu()
        for _ in range(a.rounds):
            got = await round_()
            ttfts += [t for t, _, _, _ in got]
            chunks += sum(n for _, n, _, _ in got)
            prompt_tokens += [p for _, _, p, _ in got]
        after = await server.cpu()
        prof = await server.profile(start=False) if profile else None
    n = a.rounds * a.clients
    out = {k: 1e3 * (after[k] - before.get(k, 0.0)) / n for k in after}
    out.update(ttft_ms=1e3 * statistics.mean(ttfts), chunks=chunks / n,
               prompt_tokens=statistics.mean(p for p, _ in prompt_tokens),
               hits=sum(c for _, c in prompt_tokens) / sum(p for p, _ in prompt_tokens), profile=prof)
    return out


def print_profile(path: Path, top: int) -> None:
    import pstats

    st = pstats.Stats(str(path))
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)


async def measure(server: Server, a: argparse.Namespace) -> dict:
    intake = await phase(server, a, 1, a.profile == "intake")
    stream = await phase(server, a, a.max_tokens, a.profile == "stream")
    extra = max(1.0, stream["chunks"] - intake["chunks"])
    per_chunk = {k: (stream.get(k, 0) - intake.get(k, 0)) / extra for k in ("loop", "workers", "scheduler")}
    return {"intake": intake, "stream": stream, "per_chunk": per_chunk}


def show(label: str, m: dict) -> None:
    i, s, c = m["intake"], m["stream"], m["per_chunk"]
    print(f"{label:>10}: per request (max_tokens 1): loop {i['loop']:.3f} ms, workers {i.get('workers', 0):.3f} ms, "
          f"scheduler {i['scheduler']:.3f} ms, TTFT {i['ttft_ms']:.1f} ms | per extra chunk: loop "
          f"{1e3 * c['loop']:.1f} us, scheduler {1e3 * c['scheduler']:.1f} us | streamed request: loop "
          f"{s['loop']:.2f} ms ({s['chunks']:.0f} chunks), TTFT {s['ttft_ms']:.1f} ms; prompts {i['prompt_tokens']:.0f} "
          f"tokens, {i['hits']:.0%} / {s['hits']:.0%} cached", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        return serve(Path(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--server-args", default="--context-length 8192 --mamba-cache-strategy extra_buffer --mamba-track-interval 64", help="more `mambaserve serve` flags")
    p.add_argument("--endpoint", choices=("chat", "generate"), default="chat",
                   help="chat: /v1/chat/completions with text (tokenized by the server); generate: /generate with "
                        "token ids, as multiturn.py sends them (no tokenizer, no chat template)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--history", type=int, default=1100, help="mean tokens of chat history per request")
    p.add_argument("--question", type=int, default=64, help="new tokens per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="servers per code path (alternating with --baseline)")
    p.add_argument("--baseline", help="a git ref whose server/ is measured the same way, alternating")
    p.add_argument("--profile", choices=("intake", "stream"), help="cProfile the event loop in this phase")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    paths: list[tuple[str, Path | None]] = [("current", None)]
    if a.baseline:
        paths.insert(0, (a.baseline, baseline_tree(a.baseline, Path(tempfile.mkdtemp(prefix="http-baseline-")))))
    results: dict[str, list[dict]] = {label: [] for label, _ in paths}
    for _ in range(a.repeats):
        for label, pythonpath in paths:
            server = Server(a, pythonpath, label.replace("/", "_"))
            try:
                m = asyncio.run(measure(server, a))
            finally:
                server.stop()
            show(label, m)
            results[label].append(m)
            for ph in ("intake", "stream"):
                if m[ph]["profile"] is not None:
                    print(f"--- {label}: the event loop's profile, phase {ph}")
                    print_profile(m[ph]["profile"], a.top)

    def best(label: str, key: str, sub: str) -> float:  # the least of the repeats: the least disturbed
        return min(m[key].get(sub, 0) for m in results[label])

    print("\nleast over the repeats (ms of CPU time; per chunk in us):")
    for label, _ in paths:
        print(f"{label:>10}: loop per request {best(label, 'intake', 'loop'):.3f} ms + workers "
              f"{best(label, 'intake', 'workers'):.3f} ms, loop per chunk "
              f"{1e3 * best(label, 'per_chunk', 'loop'):.1f} us, streamed request's loop total "
              f"{best(label, 'stream', 'loop'):.2f} ms")
    if a.baseline:
        b, c = a.baseline, "current"
        for key, sub, what in (("intake", "loop", "loop per request"), ("per_chunk", "loop", "loop per chunk"),
                               ("stream", "loop", "loop per streamed request"),
                               ("intake", "workers", "workers per request")):
            if best(b, key, sub) > 0:  # (no workers over /generate: nothing is tokenized)
                print(f"{what}: current / {b} = {best(c, key, sub) / best(b, key, sub):.2f}")


if __name__ == "__main__":
    main()

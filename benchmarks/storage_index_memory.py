"""Memory of the storage tier's index: bytes per entry and per token of its key, on the CPU.

The storage tier keeps an index of every entry in its directory (a radix tree over the entries' token keys,
their names and sizes): its memory grows with the entries the directory holds, so with --storage-size (or
the free disk) and the keys' lengths. This builds a real engine with a storage tier on a temporary directory
and adds N entries to its index the way a scan or a finished write does (``StorageTier._add``; no state is
written, only the index is measured), with tracemalloc, in two shapes: chats (12 turns of 16 new tokens,
an entry per turn, each extending the last) and unrelated long prompts. Baseline in the same process: the
same keys inserted into a bare radix tree as tuples of the request's own ints (what the index held before it
shared one int object per token id; without the entries' names and sizes).

  python3 benchmarks/storage_index_memory.py --model models/mamba2-tiny-pystdlib
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import tracemalloc

from mambaserve.server.cache import storage_entry as fmt
from mambaserve.server.cache.radix_tree import MambaRadixCache
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine


def chats(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    keys = []
    for _ in range(n // 12):
        history: list[int] = []
        for _ in range(12):
            history = history + [rng.randrange(vocab) for _ in range(16)]
            keys.append(history)
    return keys


def prompts(rng: random.Random, n: int, vocab: int, length: int = 2000) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def measure(add, keys: list[list[int]]) -> int:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, key in enumerate(keys):
        # ints of their own, as a request's tokens are (parsed from its body): what the index keeps of them counts
        add(fmt.entry_name(key, 1), [t + 0 for t in key], i)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/mamba2-tiny-pystdlib")
    p.add_argument("--entries", type=int, default=6000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(ServerConfig(model=a.model, device="cpu", storage_dir=d, mamba_cache_size=8,
                                     max_running_requests=4))
        vocab = engine.dims.vocab_size
        print(f"{'shape':<34} {'entries':>8} {'tokens':>9} {'index MiB':>10} {'B/entry':>8} {'B/token':>8}"
              f" {'as tuples MiB':>14}")
        for shape, keys in (("chats (12 turns x 16 tokens)", chats(random.Random(0), a.entries, vocab)),
                            ("unrelated 2000-token prompts", prompts(random.Random(1), a.entries // 20, vocab))):
            tier = engine.scheduler.storage  # (the second shape's entries go beside the first's)
            used = measure(lambda name, key, size: tier._add(name, key, size), keys)
            plain = MambaRadixCache(1)
            baseline = measure(lambda name, key, i: plain.insert(tuple(key), i + 1), keys)
            tokens = sum(len(k) for k in keys)
            print(f"{shape:<34} {len(keys):8d} {tokens:9d} {used / 2**20:10.1f} {used / len(keys):8.0f}"
                  f" {used / tokens:8.1f} {baseline / 2**20:14.1f}")
        engine.scheduler.storage.close()


if __name__ == "__main__":
    main()

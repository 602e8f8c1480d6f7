"""Which CUDA graph a step replays: pure bucket arithmetic (the replays themselves: test_gpu_engine.py)."""

from mambaserve.server.engine.cuda_graphs import PrefillGraphs, buckets_up_to, prefill_buckets


def test_decode_buckets_cover_every_batch_up_to_the_limit():
    for n in (1, 7, 33, 256, 300):
        b = buckets_up_to(n)
        assert b == sorted(set(b)) and b[-1] == n and all(any(x >= k for x in b) for k in range(1, n + 1))


def test_prefill_buckets_hold_every_step_up_to_the_chunk_with_one_padding_sequence():
    buckets = prefill_buckets(2048, 256)
    assert max(t for _, t in buckets) == 2048 and max(s for s, _ in buckets) == 33
    assert all(s - 1 <= t for s, t in buckets)
    assert prefill_buckets(16, 6) == [(2, 16), (3, 16), (5, 16), (9, 16)]  # a chunk of 16; 6 running at most
    assert [t for s, t in prefill_buckets(3000, 8) if s == 2][-2:] == [2048, 3000]  # the chunk is the last bucket
    assert max(t for _, t in prefill_buckets(16384, 8)) == 8192  # longer chunks run eagerly past 8192


def test_a_batch_runs_in_the_smallest_bucket_with_room_for_its_padding():
    graphs = PrefillGraphs.__new__(PrefillGraphs)  # the choice needs only the buckets
    graphs.buckets = prefill_buckets(2048, 256)
    assert graphs.bucket(1, 15) == (2, 16)
    assert graphs.bucket(1, 16) == (2, 16)  # the padding sequence may be empty
    assert graphs.bucket(2, 16) == (3, 16)
    assert graphs.bucket(4, 100) == (5, 128)
    assert graphs.bucket(10, 2048) == (17, 2048)
    assert graphs.bucket(32, 40) == (33, 64)
    assert graphs.bucket(8, 640) == (9, 640)  # a multi-turn round's 8 hits of 80 new tokens: no padding
    assert all(graphs.bucket(8, t)[1] <= 4 * t / 3 for t in range(512, 2049))  # hits' sizes: padded 1.33x at most
    assert graphs.bucket(33, 64) is None  # more sequences than any graph: eager
    assert graphs.bucket(1, 2049) is None

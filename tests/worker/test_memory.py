"""The worker's memory helpers on a real heap."""

from __future__ import annotations

import numpy as np

from omnifabric.worker.engines.memory import return_free_heap, rss_bytes


def test_free_heap_goes_back_to_the_system():
    # 3000 arrays of 96 KiB sit on the heap (glibc maps only larger blocks on their own).
    # Every tenth is kept, so the freed ones leave holes inside the heap that free() keeps
    # resident (it gives back only the heap's top) until the allocator is asked to trim.
    blocks = [np.ones(12 * 1024) for _ in range(3000)]
    kept = blocks[::10]
    del blocks
    before = rss_bytes()
    assert return_free_heap()
    after = rss_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert len(kept) == 300

import pytest

from common.policy import (cold_position, continued_frontiers, frontier, lru_victims,
                           prefix_position, should_evict_save)

D = dict(min_tokens=512, cold_max=30000, align=2048, trim=32)     # ds4-server's defaults (docs/kv-format.md)


def test_cold_seed_example():
    assert cold_position(10500, 0, **D) == 10208
    assert cold_position(10240, 0, **D) == 10208
    assert cold_position(10239, 0, **D) == 8192 - 32
    assert cold_position(30000, 0, **D) == 28672 - 32
    assert cold_position(2048, 0, **D) == 2016


def test_cold_range_and_fallback():
    assert cold_position(511, 0, **D) is None            # below the minimum
    assert cold_position(30001, 0, **D) is None          # above cold max
    assert cold_position(512, 0, **D) is None            # 0 - 32 < 512 and 512 - 32 < 512
    assert cold_position(544, 0, **D) == 512             # fallback: n - trim reaches the minimum
    assert cold_position(1000, 0, **D) == 968
    assert cold_position(2047, 0, **D) == 2015
    assert cold_position(2079, 0, **D) == 2016
    # small values
    small = dict(min_tokens=4, cold_max=100, align=8, trim=2)
    assert cold_position(21, 0, **small) == 14
    assert cold_position(9, 0, **small) == 6
    assert cold_position(7, 0, **small) == 5             # 0 - 2 < 4, 7 - 2 = 5
    assert cold_position(5, 0, **small) is None          # 5 - 2 < 4
    assert cold_position(16, 0, **dict(small, trim=0)) == 16


def test_cold_beyond_reused():
    assert cold_position(10500, 4000, **D) == 10208      # only a shorter prefix was reused
    assert cold_position(10500, 10207, **D) == 10208
    assert cold_position(10500, 10208, **D) is None      # nothing new to store
    assert cold_position(10500, 10400, **D) is None
    with pytest.raises(ValueError):
        cold_position(10500, 0, 512, 30000, 0, 32)


def test_prefix_position():
    assert prefix_position(3000, 10500, 0, 512, 30000) == 3000
    assert prefix_position(300, 10500, 0, 512, 30000) is None       # part below the minimum
    assert prefix_position(3000, 10500, 3000, 512, 30000) is None    # already reused
    assert prefix_position(3000, 40000, 0, 512, 30000) is None       # prompt above cold max


def test_continued_defaults():
    assert frontier(1, 10000, 2048) == 10240
    assert frontier(2, 10000, 2048) == 20480
    assert frontier(3, 10000, 2048) == 30720
    assert continued_frontiers(0, 25000, 10000, 2048, 0) == [10240, 20480]
    assert continued_frontiers(10000, 10240, 10000, 2048, 0) == [10240]   # end inclusive
    assert continued_frontiers(10240, 20000, 10000, 2048, 0) == []        # start exclusive
    assert continued_frontiers(0, 25000, 10000, 2048, 10240) == [20480]   # beyond last stored
    assert continued_frontiers(0, 25000, 10000, 2048, 20480) == []
    assert continued_frontiers(20480, 20481, 10000, 2048, 10240) == []
    assert continued_frontiers(30719, 30720, 10000, 2048, 20480) == [30720]   # one decode step
    assert continued_frontiers(0, 10239, 10000, 2048, 0) == []


def test_continued_small_values():
    assert continued_frontiers(0, 40, 10, 4, 0) == [12, 20, 32, 40]
    assert continued_frontiers(0, 20, 3, 8, 0) == [8, 16]           # 3,6 -> 8; 9,12,15 -> 16
    assert continued_frontiers(5, 30, 10, 1, 20) == [30]
    assert continued_frontiers(0, 100, 0, 8, 0) == []                # interval 0: disabled
    big = continued_frontiers(999_000, 1_000_000, 10000, 2048, 0)
    assert big == [f for f in (frontier(i, 10000, 2048) for i in range(1, 200))
                   if 999_000 < f <= 1_000_000]


def test_should_evict_save():
    assert should_evict_save(5000, 1000, 512, False)
    assert should_evict_save(1512, 1000, 512, False)                # lost exactly the minimum
    assert not should_evict_save(1511, 1000, 512, False)
    assert not should_evict_save(5000, 1000, 512, True)             # already on disk
    assert not should_evict_save(5000, 5000, 512, False)            # nothing lost
    assert not should_evict_save(5000, 6000, 0, False)
    assert should_evict_save(600, 0, 512, False)


def test_lru_order():
    entries = [("a", 40, 300, 10), ("b", 40, 100, 50), ("c", 40, 100, 20), ("d", 40, 500, 1)]
    assert lru_victims(entries, 160, set()) == []
    assert lru_victims(entries, 159, set()) == ["c"]                 # oldest use, older creation
    assert lru_victims(entries, 80, set()) == ["c", "b"]
    assert lru_victims(entries, 0, set()) == ["c", "b", "a", "d"]
    assert lru_victims([], 0) == []


def test_lru_keep():
    entries = [("old", 50, 1, 1), ("mid", 50, 2, 2), ("new", 50, 3, 3)]
    assert lru_victims(entries, 100, {"old"}) == ["mid"]
    assert lru_victims(entries, 60, {"old"}) == ["mid", "new"]
    assert lru_victims(entries, 40, {"old"}) == ["old", "mid", "new"]   # "old" alone exceeds 40
    assert lru_victims(entries, 60, {"old", "new"}) == ["mid"]          # kept ones stay, total 100
    # an oversized entry goes first, so smaller recent ones are not sacrificed for it
    big = [("small", 10, 1, 1), ("huge", 500, 9, 9)]
    assert lru_victims(big, 100, set()) == ["huge"]
    assert lru_victims(big, 100, {"huge"}) == ["huge"]


def test_common_prefix_equals_counting_id_by_id():
    """Block by block (policy.PREFIX_BLOCK ids a compare): divergences before, at and after a
    block's edge, one sequence inside the other, a list against a tuple."""
    import random
    from common.policy import PREFIX_BLOCK, common_prefix

    def naive(a, b):
        k = 0
        for x, y in zip(a, b):
            if x != y:
                break
            k += 1
        return k
    rnd = random.Random(7)
    cuts = [0, 1, PREFIX_BLOCK - 1, PREFIX_BLOCK, PREFIX_BLOCK + 1, 3 * PREFIX_BLOCK + 5]
    for cut in cuts:
        for extra in (0, 1, PREFIX_BLOCK):
            a = [rnd.randrange(100) for _ in range(cut + extra + 3)]
            b = a[:cut] + [x + 1 for x in a[cut:]]
            for x, y in ((a, b), (a, tuple(b)), (tuple(a), b), (a[:cut], a), (a, a[:cut + extra])):
                assert common_prefix(x, y) == naive(x, y), (cut, extra)
    assert common_prefix([], [1]) == 0 and common_prefix((1, 2), (1, 2)) == 2

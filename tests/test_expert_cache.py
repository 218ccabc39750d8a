"""ExpertCache: which experts stay between passes, within its budget."""

from __future__ import annotations

from shardstream.stream.expert_cache import ExpertCache


def _run(cache: ExpertCache, passes: list[list[int]]) -> None:
    """Each pass routes block 0 to the experts listed; a miss is offered to the cache, as the runtime does."""
    for routed in passes:
        cache.tick(0)
        for expert in routed:
            if cache.get(0, expert) is None:
                cache.offer(0, expert, expert, 10)


def test_frequent_expert_outlasts_a_burst_of_rare_ones_where_lru_drops_it():
    popular_then_rare = [[0]] * 6 + [[1], [2], [3]] + [[0]]
    freed: list[int] = []
    lru = ExpertCache(20, half_life=0, release=freed.append)
    _run(lru, popular_then_rare)
    assert lru.stats.hits == 5 and 0 in freed   # dropped by the rare ones, read again
    frequent = ExpertCache(20, half_life=16, release=lambda held: None)
    _run(frequent, popular_then_rare)
    assert frequent.stats.hits == 6 and frequent.stats.misses == 4   # expert 0 read once, kept throughout


def test_budget_is_never_exceeded_and_shrinking_drops_the_least_scored():
    freed: list[int] = []
    cache = ExpertCache(30, half_life=16, release=freed.append)
    _run(cache, [[0, 1, 2, 3, 4]] + [[4]] * 3)
    assert cache.held_bytes == cache.peak_bytes == 30 and len(cache) == 3
    cache.shrink(10)
    assert cache.held_bytes == 10 and cache.get(0, 4) == 4   # the most routed one stays
    assert not cache.offer(0, 9, 9, 11)   # larger than the whole budget
    cache.clear()
    assert cache.held_bytes == 0 and len(cache) == 0


def test_experts_a_pass_still_needs_are_not_dropped_to_make_room():
    freed: list[int] = []
    cache = ExpertCache(20, half_life=16, release=freed.append)
    _run(cache, [[0, 1]] * 3)
    cache.tick(0)
    assert cache.get(0, 0) == 0 and cache.get(0, 1) == 1 and cache.get(0, 2) is None
    assert not cache.offer(0, 2, 2, 10, keep=frozenset({0, 1})) and not freed

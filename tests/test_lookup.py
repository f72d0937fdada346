import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.drafting import lookup
from selfspec.drafting.lookup import ContextIndex


# -- brute force: scan the whole context for every query ------------------------------------------
def occurrences(ctx, pattern):
    """End positions of `pattern` in ctx that have at least one token after them."""
    n = len(pattern)
    return [e for e in range(n - 1, len(ctx) - 1) if ctx[e - n + 1 : e + 1] == pattern]


def longest_match(ctx, suffix, lo, hi):
    for n in range(hi, lo - 1, -1):
        if len(suffix) >= n:
            ends = occurrences(ctx, list(suffix[-n:]))
            if ends:
                return ends
    return []


def brute_propose(ctx, suffix, k, lo, hi):
    ends = longest_match(ctx, suffix, lo, hi)
    if not ends:
        return []
    full = [e for e in ends if len(ctx) - 1 - e >= k]
    e = max(full) if full else min(ends)
    return ctx[e + 1 : e + 1 + k]


def brute_continuations(ctx, suffix, limit, lo, hi):
    stats = {}
    for e in longest_match(ctx, suffix, lo, hi):
        count, _ = stats.get(ctx[e + 1], (0, -1))
        stats[ctx[e + 1]] = (count + 1, e)
    return sorted(stats, key=lambda t: (-stats[t][0], -stats[t][1]))[:limit]


# -- worked examples ------------------------------------------------------------------------------
def test_propose_copies_the_most_recent_full_length_continuation():
    idx = ContextIndex([5, 6, 7, 5, 6, 8, 5, 6])
    assert idx.propose([5, 6], 3) == [8, 5, 6]  # (5, 6) ends at 1 and 4; 4 has 3 tokens after it


def test_propose_falls_back_to_the_earliest_occurrence_when_none_has_a_full_continuation():
    idx = ContextIndex([5, 6, 7, 5, 6, 8, 5, 6])
    assert idx.propose([5, 6], 4) == [7, 5, 6, 8]


def test_propose_continues_a_periodic_tail_for_the_full_length_like_transformers():
    idx = ContextIndex([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], max_ngram=2)
    assert idx.propose([1, 2], 6) == [3, 1, 2, 3, 1, 2]  # not cut to the period


def test_propose_prefers_the_longest_ngram():
    # the 1-gram (6) is last followed by 9, the 3-gram (4, 5, 6) by 7
    idx = ContextIndex([4, 5, 6, 7, 0, 6, 9, 0])
    assert idx.propose([4, 5, 6], 1) == [7]
    assert idx.propose([3, 8, 6], 1) == [9]  # (3, 8, 6) and (8, 6) unseen: the 1-gram (6) matches
    assert ContextIndex([4, 5, 6, 7, 0, 6, 9, 0], max_ngram=1).propose([4, 5, 6], 1) == [9]


def test_a_suffix_beyond_the_context_matches_inside_the_context():
    idx = ContextIndex([10, 11, 12, 13, 14, 20])
    assert idx.propose([20, 99, 11, 12], 2) == [13, 14]  # a tree path's tokens after the context


def test_no_match_gives_nothing_and_no_error():
    idx = ContextIndex([1, 2, 3], min_ngram=2)
    assert idx.propose([3], 4) == []  # shorter than min_ngram
    assert idx.propose([], 4) == [] and idx.continuations([], 2) == []
    assert idx.propose([2, 3], 4) == []  # the context's last 2-gram has no token after it
    assert ContextIndex([]).propose([1, 2], 3) == []


def test_continuations_are_distinct_most_frequent_then_most_recent():
    idx = ContextIndex([5, 6, 7, 5, 6, 8, 5, 6])
    assert idx.continuations([5, 6], 4) == [8, 7]
    idx.extend([7])
    assert idx.continuations([5, 6], 4) == [7, 8]
    assert idx.continuations([5, 6], 1) == [7]


def test_tensors_are_accepted_as_token_sequences():
    idx = ContextIndex(torch.tensor([5, 6, 7, 5, 6, 8]))
    assert idx.propose(torch.tensor([5, 6]), 1) == [8]
    assert idx.continuations(torch.tensor([6]), 3) == [8, 7]


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("lo, hi", [(0, 3), (3, 2), (-1, 1), (2, 1)])
def test_bad_ngram_bounds_are_one_clear_error(lo, hi):
    with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
        ContextIndex([1, 2], min_ngram=lo, max_ngram=hi)


@pytest.mark.parametrize("k", [0, -2, 1.5])
def test_bad_token_counts_are_one_clear_error(k):
    idx = ContextIndex([1, 2, 1, 2])
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
        idx.propose([1], k)
    with pytest.raises(ValueError, match="limit must be an integer >= 1"):
        idx.continuations([1], k)


# -- against the brute force ----------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 4), lo=st.integers(1, 3), span=st.integers(0, 2))
def test_index_with_random_extends_matches_a_brute_force_suffix_search(data, vocab, lo, span):
    hi = lo + span
    tok = st.integers(0, vocab - 1)
    ctx = data.draw(st.lists(tok, max_size=30))
    idx = ContextIndex(ctx, min_ngram=lo, max_ngram=hi)
    for _ in range(data.draw(st.integers(1, 4))):
        for _ in range(3):
            # suffixes: the context's own tail, or that tail with uncommitted (path) tokens after it
            cut = data.draw(st.integers(0, len(ctx)))
            suffix = ctx[cut:] + data.draw(st.lists(tok, max_size=4))
            k = data.draw(st.integers(1, 8))
            assert idx.propose(suffix, k) == brute_propose(ctx, suffix, k, lo, hi)
            assert idx.continuations(suffix, k) == brute_continuations(ctx, suffix, k, lo, hi)
        more = data.draw(st.lists(tok, max_size=12))
        idx.extend(more)
        ctx = ctx + more
        assert len(idx) == len(ctx)


# -- cost -----------------------------------------------------------------------------------------
def test_extend_touches_at_most_max_ngram_entries_per_token_whatever_the_context_length(monkeypatch):
    adds = []
    real_add = lookup._Node.add
    monkeypatch.setattr(lookup._Node, "add", lambda node, end, token: (adds.append(end), real_add(node, end, token)))
    g = torch.Generator().manual_seed(0)
    for length in (10, 5000):
        idx = ContextIndex(torch.randint(0, 8, (length,), generator=g).tolist(), min_ngram=1, max_ngram=3)
        idx.match_length([0])  # the first read indexes the context
        adds.clear()
        idx.extend([1, 2, 3, 4])
        assert adds == [] and len(idx) == length + 4  # appended; indexed when next read (AR rounds read nothing)
        assert idx.propose([3, 4], 2) == idx.propose([3, 4], 2)
        # one update per n (1..3) per appended token, all at the newest positions: no rescan
        assert len(adds) == 4 * 3
        assert min(adds) == length - 1


def test_match_length_is_the_n_of_the_ngram_propose_copies_after():
    idx = ContextIndex([5, 6, 7, 5, 6, 8, 1], min_ngram=1, max_ngram=3)
    assert idx.match_length([5, 6]) == 2 and idx.match_length([9, 5, 6]) == 2
    assert idx.match_length([7, 5, 6]) == 3 and idx.match_length([4]) == 0
    assert ContextIndex([5, 6, 7], min_ngram=2, max_ngram=3).match_length([6]) == 0


@pytest.mark.parametrize("enabled", [True, False])
def test_a_bulk_index_leaves_the_garbage_collector_as_it_found_it(enabled):
    """A prompt's worth of tokens is indexed with the cyclic GC off, then it is back on; one that
    was off stays off."""
    import gc

    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        idx = ContextIndex(list(range(50)) * 30, min_ngram=1, max_ngram=3)  # 1,500 tokens: past BULK
        assert len(idx._new) >= lookup.BULK
        assert idx.propose([48, 49], 3) == [0, 1, 2]
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_prompt_is_indexed_with_its_prefill_so_that_no_round_pays_for_it():
    # a first forecast that indexed a 1,000-token prompt took 3.7 ms, charged to speculation as a lost bet
    from selfspec.engine.schedule.decoder import Decoder
    from selfspec.engine.request.options import DecodeConfig

    from conftest import tiny_model

    m = tiny_model(seed=1)
    prompt = torch.randint(5, 60, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for mode in ("auto", "lookup"):
        dec = Decoder(m, [prompt], DecodeConfig(mode=mode, max_new_tokens=8), eos_token_id=[])
        next(iter(dec))  # the prefill's first token
        index = dec.sequences[0].lookup
        assert index._tokens == prompt and len(index._new) == 1, mode  # the first token waits for a lookup

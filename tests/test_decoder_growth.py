"""A server runs for weeks: finished and forgotten requests leave nothing behind in the decoder.

Thousands of short requests go through one `Decoder` the way the server's engine thread feeds it
(`Decoder.add`, turns, `Decoder.forget` once a finished row has left: `serving/openai_api/engine.py`,
`Engine._settle`). After a warm-up, every per-request container of the decoder, its scheduler,
stepper, cache and planner keeps its size, and so does the whole graph reachable from the decoder
(objects and container slots), so no state of any kind grows with the number of requests served.
"""

import gc
import types

import pytest
import torch

from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.sequence import SamplingParams

from conftest import tiny_model

V = 16
REQUESTS, WARM_UP, CHECK_EVERY = 3200, 400, 400
# bounded state may still fill in after the warm-up (the planner's rate for a draining batch, a
# cache scratch entry of a width not seen yet): a few objects, while one object per request left
# behind adds CHECK_EVERY between two checks
SLACK = 64
PER_REQUEST = ("sequences", "prompts", "params", "outputs", "stats", "observers", "waiting", "live")
CONFIGS = {
    # the planner (calibration, overheads, rest), lookup indices and n-gram rho per row
    "auto": dict(mode="auto", block_length=4, budget=4, group_size=4),
    # a fixed one-pass tree: marginals carried from round to round
    "presto one-pass": dict(mode="presto", schedule="one-pass", block_length=4, budget=4),
}


def _fake_clock(monkeypatch):
    """Round times are what plan "auto" learns from: a clock that ticks 1 ms per reading makes
    the planner's choices, and so the shapes it memoises, the same on every machine."""
    from selfspec.engine.planning import planner as planner_mod
    from selfspec.engine.round import step as step_mod

    ticks = iter(range(10**9))
    clock = types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3)
    monkeypatch.setattr(step_mod, "time", clock)
    if hasattr(planner_mod, "time"):
        monkeypatch.setattr(planner_mod, "time", clock)


def _sizes(dec: Decoder) -> dict:
    """The length of every per-request container the decoder and its parts hold."""
    sched, step, pl = dec.scheduler, dec.stepper, dec.planner
    out = {name: len(getattr(dec, name)) for name in ("sequences", "prompts", "params", "outputs", "stats")}
    out.update(observers=len(dec._observers), waiting=len(sched.waiting), live=len(sched.live),
               cache_rows=step.cache.rows, cache_lengths=len(step.cache.lengths), cache_scratch=len(step.cache.scratch))
    if pl is not None:
        for k, v in vars(pl).items():
            if isinstance(v, (list, dict, set)):
                out[f"planner.{k}"] = len(v)
    return out


def _reachable(root) -> tuple[int, int]:
    """(objects, container slots) reachable from `root`, not counting the model's modules, code,
    classes or what tensors hold (their storage is fixed: the cache, the weights)."""
    stop = (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType, types.CodeType, torch.Generator)
    seen, todo, slots = {id(root)}, [root], 0
    while todo:
        obj = todo.pop()
        if isinstance(obj, (list, dict, set, frozenset, tuple)) or type(obj).__name__ == "deque":
            slots += len(obj)
        if isinstance(obj, stop) and obj is not root:
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen:
                seen.add(id(ref))
                todo.append(ref)
    return len(seen), slots


def _serve(dec: Decoder, n: int, start: int, in_flight: int = 6):
    """Requests start .. start+n-1, about `in_flight` at a time, through add / turn / forget as the
    server's engine thread runs them; 1 or 2 new tokens each, greedy or sampled with a seed."""
    jobs, i = {}, start
    while i < start + n or jobs:
        while i < start + n and len(jobs) < in_flight:
            prompt = [5 + (i * 7 + k) % (V - 5) for k in range(2 + i % 5)]
            params = SamplingParams(max_new_tokens=1 + i % 2, temperature=0.0 if i % 3 else 1.0, top_p=0.9)
            seq = dec.add(prompt, params=params, seed=i if i % 3 == 0 else None)
            jobs[seq.index] = seq
            i += 1
        for row, chunk in dec.turn():
            assert row in jobs and all(0 <= t < V for t in chunk)
        live = set(map(id, dec.scheduler.live))
        for row, seq in list(jobs.items()):
            if seq.done and id(seq) not in live:
                assert len(seq.emitted) == seq.params.max_new_tokens  # eos_token_id=[]: never stops early
                dec.forget(seq)
                del jobs[row]


@pytest.fixture
def one_thread():
    """A tiny model's kernels on one thread: two threads on a shared 2-core machine spend 10-40x
    longer waiting for each other than computing."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forgotten_requests_leave_nothing_behind(name, monkeypatch, one_thread):
    _fake_clock(monkeypatch)
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=2, **CONFIGS[name])
    dec = Decoder(m, [], cfg, batch_size=4, eos_token_id=[],
                  profile=CostModel.flat() if cfg.mode == "auto" else None)
    dec.start()
    _serve(dec, WARM_UP, 0)
    sizes, reach = _sizes(dec), _reachable(dec)
    assert all(sizes[k] == 0 for k in PER_REQUEST), sizes
    for start in range(WARM_UP, REQUESTS, CHECK_EVERY):
        _serve(dec, CHECK_EVERY, start)
        now, served = _sizes(dec), f"after {start + CHECK_EVERY} requests"
        assert {k: now[k] for k in PER_REQUEST} == {k: 0 for k in PER_REQUEST}, served
        assert all(now[k] <= sizes.get(k, 0) + SLACK for k in now), (served, now, sizes)
        objects, slots = _reachable(dec)
        assert objects <= reach[0] + SLACK and slots <= reach[1] + SLACK, (served, (objects, slots), reach)


def test_a_decoders_views_read_its_sequences_by_index_and_behave_as_lists():
    """`outputs`, `stats`, `params`, `prompts` and `sequences` read the sequences (their own
    objects), exist from construction, are keyed by sequence index after a `forget`, behave as
    lists (==, len, JSON) and refuse edits: a row's state has one owner, its sequence."""
    import json

    m = tiny_model(vocab_size=V)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    dec = Decoder(m, prompts, DecodeConfig(mode="ar", max_new_tokens=2), eos_token_id=[], batch_size=3)
    assert dec.outputs == [[], [], []] and len(dec.stats) == 3 and dec.prompts == prompts
    assert dec.stats[1] is dec.sequences[1].stats and dec.params[2] is dec.sequences[2].params
    for _ in dec:
        pass
    later = dec.add([14, 15])
    while dec.busy:
        dec.step()
    dec.forget(dec.sequences[1])
    outs = [dec.sequences[i].emitted for i in (0, 2, 3)]
    assert dec.outputs == outs and all(len(o) == 2 for o in outs) and dec.outputs[3] is later.emitted
    assert dec.outputs.indices() == [0, 2, 3] and dec.prompts[2] == prompts[2] and len(dec.stats) == 3
    for view in (dec.outputs, dec.stats, dec.params, dec.prompts, dec.sequences):
        with pytest.raises(KeyError, match="forgotten"):
            view[1]
    with pytest.raises(TypeError):
        dec.outputs.append([1])
    with pytest.raises(TypeError):
        dec.stats[0] = None
    with pytest.raises(TypeError):
        del dec.sequences[0]
    assert json.loads(json.dumps(dec.outputs)) == outs

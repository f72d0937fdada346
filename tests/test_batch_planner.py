"""The batch planner and the cost profile's batch axis: the layout follows f(B, q) and what the
verifier accepted; bad profile files are refused by name; measurement is monotone."""

import json

import pytest
import torch

from selfspec.engine.batch_planner import AR, PROBE_MIN, BatchOption, BatchPlanner
from selfspec.engine.batch_profile import BatchProfile, _monotone, batch_cost_model, measure_batch

from conftest import tiny_model


class Table:
    """f(B, q) from a dict, as measured on the project's CPU at B = 8 (ms)."""

    def __init__(self, ms):
        self.ms = ms

    def __call__(self, B, q):
        return self.ms[q] / 1000


def _trained(planner, p, rounds=200, n=4):
    for _ in range(rounds):  # lookup chains of n tokens, a share p of first tokens accepted
        planner.lookup.update(n, 1 if torch.rand(()) < p else 0, 2)


def test_lookup_is_chosen_only_when_its_yield_beats_the_width_cost():
    torch.manual_seed(0)
    cpu = Table({1: 93.0, 2: 124.0, 3: 150.0, 4: 172.0, 5: 200.0, 16: 500.0, 17: 520.0})
    chains, matches = [[1, 2, 3, 4]] * 8, [2] * 8
    likely, unlikely = BatchPlanner(cpu, two_pass=False), BatchPlanner(cpu, two_pass=False)
    _trained(likely, 0.95)
    _trained(unlikely, 0.1)
    assert likely.plan(chains, matches, 10).kind == "lookup"
    assert unlikely.plan(chains, matches, 10) is AR
    assert BatchPlanner(BatchProfile.flat(), two_pass=False).plan(chains, matches, 10) == BatchOption("lookup", 4)
    assert likely.plan([[]] * 8, matches, 10) is AR  # nothing to copy: nothing to verify
    assert likely.plan(chains, matches, 1).k <= 1  # the room caps the chain


def test_a_draining_batch_speculates_only_for_the_rows_that_end_it():
    """No prompt waits: a likely chain on a row that will finish early is not worth the wider
    round; the same chain on every row with the most tokens left is."""
    torch.manual_seed(0)
    cpu = Table({1: 93.0, 2: 124.0, 3: 150.0, 4: 172.0, 5: 200.0})
    p = BatchPlanner(cpu, two_pass=False)
    _trained(p, 0.95)
    chains, matches = [[1, 2, 3, 4], [1, 2, 3, 4], []], [2] * 3
    assert p.plan(chains, matches, 10).kind == "lookup"  # a queue keeps the batch full: tokens count
    assert p.plan(chains, matches, 10, drain=[12, 12, 30]) is AR  # the row that ends the batch gains nothing
    assert p.plan(chains, matches, 10, drain=[30, 30, 12]).kind == "lookup"  # both rows that end it do


def test_probes_come_after_a_run_of_ar_rounds_and_wait_longer_after_losing():
    p = BatchPlanner(BatchProfile.linear(per_token=1.0), two_pass=False)
    chains = [[1, 2]] * 4
    picks = [p.plan(chains, [1] * 4, 8) for _ in range(PROBE_MIN + 1)]
    assert picks[:PROBE_MIN] == [AR] * PROBE_MIN and picks[-1].kind == "lookup"
    p.observe(picks[-1], rows=4, width=3, seconds=20.0, forward_seconds=20.0, tokens=4, drafted=[2] * 4,
              accepted=[0] * 4, matches=[1] * 4)
    assert p.probe_every == 2 * PROBE_MIN
    assert p.lookup.prob(1, 1)[0] < 0.5  # the rejected chains lowered the estimate


def test_width_after_a_draft_pass_follows_the_calibrated_chain():
    p = BatchPlanner(BatchProfile.flat())
    sure, unsure = torch.zeros(7), torch.full((7,), -9.0)
    for _ in range(50):
        p.chain.update(sure, torch.ones(7, dtype=torch.bool), torch.ones(7, dtype=torch.bool))
        p.chain.update(unsure, torch.ones(1, dtype=torch.bool).expand(7), torch.zeros(7, dtype=torch.bool))
    assert p.width_after_draft([sure] * 4) == 7
    steep = BatchPlanner(BatchProfile.linear(per_token=1.0), chain=p.chain)
    assert steep.width_after_draft([unsure] * 4) == 0
    assert steep.width_after_draft([]) == 0


def test_batch_profile_round_trip_interpolation_and_bad_files(tmp_path):
    prof = BatchProfile("cpu: x", "m", "float32", (1, 4), (1, 3), ((1.0, 3.0), (2.0, 6.0)))
    assert prof(1, 2) == pytest.approx(2.0) and prof(4, 3) == pytest.approx(6.0) and prof(2, 1) == pytest.approx(4 / 3)
    path = tmp_path / "b.json"
    prof.save(str(path))
    assert BatchProfile.load(str(path))(4, 1) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="measured for model 'm'"):
        BatchProfile.load(str(path), model="other")
    raw = json.loads(path.read_text())
    raw["seconds"][0][1] = -1
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="not a valid batch cost profile"):
        BatchProfile.load(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot be read"):
        BatchProfile.load(str(path))
    with pytest.raises(FileNotFoundError, match="not found"):
        BatchProfile.load(str(tmp_path / "none.json"))
    assert _monotone([[2.0, 1.0], [1.0, 3.0]]) == ((2.0, 2.0), (2.0, 3.0))


def test_measured_batch_profile_is_monotone_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = tiny_model(seed=0, vocab_size=16)
    prof = measure_batch(m, grid_b=(1, 2, 4), grid_q=(1, 2, 4), sweeps=2, budget_s=1, progress=False)
    for row in prof.seconds:
        assert list(row) == sorted(row)
    for j in range(len(prof.q)):
        col = [row[j] for row in prof.seconds]
        assert col == sorted(col)
    first = batch_cost_model(m)
    assert list(tmp_path.rglob("*-batch.json"))
    del m._selfspec_batch_profile
    assert batch_cost_model(m) == first.__class__.load(str(next(tmp_path.rglob("*-batch.json"))))


def test_a_profile_that_underprices_wide_rounds_is_corrected_by_what_they_took():
    """The profile says a width-2 round costs what AR costs; measured lookup rounds take twice
    AR's time: after a few, a yield of 1.3 tokens per row no longer buys them."""
    torch.manual_seed(0)
    p = BatchPlanner(BatchProfile.flat(0.1), two_pass=False)
    _trained(p, 0.3, n=1)
    chains, matches = [[7]] * 4, [2] * 4
    assert p.plan(chains, matches, 8) == BatchOption("lookup", 1)
    for _ in range(5):
        p.observe(AR, rows=4, width=1, seconds=0.1, forward_seconds=0.1, tokens=4, drafted=[0] * 4,
                  accepted=[0] * 4, matches=matches)
        p.observe(BatchOption("lookup", 1), rows=4, width=2, seconds=0.2, forward_seconds=0.2, tokens=5,
                  drafted=[1] * 4, accepted=[1, 0, 0, 0], matches=matches)
    p.lookup.counts.clear()
    _trained(p, 0.3, n=1)
    assert p.plan(chains, matches, 8) is AR


def test_a_batched_round_fades_old_evidence_once_not_once_per_row():
    p = BatchPlanner(BatchProfile.flat(), two_pass=False)
    for _ in range(50):
        p.lookup.update(2, 2, 3)
    before = p.lookup.counts[3][0][0]
    p.observe(BatchOption("lookup", 2), rows=16, width=3, seconds=1.0, forward_seconds=1.0, tokens=16,
              drafted=[2] * 16, accepted=[0] * 16, matches=[3] * 16)
    assert p.lookup.counts[3][0][0] == pytest.approx(before * p.lookup.forget + 16)

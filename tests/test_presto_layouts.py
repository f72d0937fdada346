"""`mode="presto"` lays its trees out as the device affords, unless a layout is named: on CPU-like
costs it never runs the paper's wide one-pass round, on flat costs it does, and naming
`schedule="one-pass"` (or group_nodes, or plan "fixed") runs exactly the paper's layout.
Greedy output equals AR in every case."""

import re

import pytest
import torch

from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder, generate_ids
from selfspec.engine.round.rounds import config_label, fixed_option
from selfspec.engine.request.options import DecodeConfig
from selfspec.tools.cli import layout_note, main

from conftest import tiny_model

# a CPU's picture: every query token costs about a tenth of an AR step (f(561) ~ 50 f(1))
CPU = CostModel.one_row((1, 4, 16, 64, 561), ((1e-3, 1.3e-3, 3e-3, 8e-3, 50e-3),))
PRESTO = dict(mode="presto", budget=8, block_length=8, max_new_tokens=40)


def _setup():
    m = tiny_model(seed=1, vocab_size=12)
    p = torch.randint(5, 12, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    return m, p, ar


def test_presto_without_a_schedule_is_planned_and_a_named_layout_is_fixed():
    assert DecodeConfig(mode="presto").plan == "auto"
    assert config_label(DecodeConfig(mode="presto", budget=32)) == "presto/auto/N=32"
    for named in (dict(schedule="one-pass"), dict(schedule="two-pass"), dict(group_nodes=2), dict(plan="fixed")):
        cfg = DecodeConfig(mode="presto", **named)
        assert cfg.plan == "fixed" and cfg.schedule in ("one-pass", "two-pass"), named
    with pytest.raises(ValueError, match="plan 'auto' chooses PRESTO's schedule"):
        DecodeConfig(mode="presto", plan="auto", schedule="one-pass")


def test_on_cpu_like_costs_presto_runs_narrow_rounds_and_equals_ar():
    m, p, ar = _setup()
    paper = fixed_option(DecodeConfig(mode="presto", schedule="one-pass", budget=8, block_length=8)).width
    dec = Decoder(m, [p], DecodeConfig(**PRESTO), eos_token_id=[], profile=CPU)
    widths = []
    dec.on_round = lambda info: widths.append(info["query_tokens"])
    for _ in dec:
        pass
    assert dec.outputs[0] == ar
    assert widths and max(widths) < paper // 2, widths  # the paper's 81-token round never runs
    assert not any(label.startswith("lookup") for label in dec.stats[0].plan_hist)  # trees, not chains


def test_on_flat_costs_presto_plans_the_papers_wide_one_pass_rounds():
    m, p, ar = _setup()
    out, st = generate_ids(m, p, DecodeConfig(**PRESTO), eos_token_id=[], profile=CostModel.flat())
    assert out == ar
    assert any("/m=" in label and int(re.search(r"N=(\d+)", label).group(1)) >= 4 for label in st.plan_hist), \
        st.plan_hist  # trees of 4 nodes or more with mask groups


def test_naming_the_papers_schedule_runs_it_every_round():
    m, p, ar = _setup()
    out, st = generate_ids(m, p, DecodeConfig(**PRESTO, schedule="one-pass"), eos_token_id=[])
    assert out == ar
    assert set(st.plan_hist) == {"presto/one-pass/N=8"}


def test_the_note_says_what_the_papers_layout_costs_and_how_to_name_it():
    m, _, _ = _setup()
    note = layout_note(m, DecodeConfig(mode="presto", budget=32), CPU)
    assert "laid out per round" in note and "561 query tokens" in note and "--schedule one-pass" in note
    fixed = layout_note(m, DecodeConfig(mode="presto", budget=32, schedule="one-pass"), CPU)
    assert "costs ~50 AR steps" in fixed
    assert layout_note(m, DecodeConfig(mode="presto", budget=32, schedule="one-pass"), CostModel.flat()) is None
    assert layout_note(m, DecodeConfig(mode="ar"), CPU) is None


def test_the_cli_says_the_layout_before_and_the_rounds_by_layout_after(tiny_dir, tmp_path, capsys):
    prof = tmp_path / "cpu.json"
    CPU.save(str(prof))
    rc = main(["generate", "--model", str(tiny_dir), "--prompt", "x", "--mode", "presto", "--budget", "8",
               "--block-length", "4", "--max-new-tokens", "12", "--profile", str(prof)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "note: PRESTO is laid out per round" in err
    assert re.search(r"\[presto/auto/N=8\] \d+ tokens.*rounds by layout: ", err), err

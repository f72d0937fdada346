"""The bench's floor lines show how far one repeat's ratio strays (`repeat_speedups`) and whether
the worst prompt's loss came with any bet placed (its AR rounds)."""
import pytest

from selfspec.tools.bench_report import _summed, _worst, floor_lines, repeat_speedups


def _runs(pid, seconds, *, tokens=10, ar_rounds=None):
    recs = []
    for s in seconds:
        rec = {"id": pid, "token_ids": [1] * tokens, "new_tokens": tokens, "seconds": s}
        if ar_rounds is not None:
            rec.update(rounds=6, plan_hist={"ar": ar_rounds, "lookup/N=2": 6 - ar_rounds})
        recs.append(rec)
    return _summed(recs)


def _rows():
    """The docstring's example: AR 1.0 / 1.0 s on a, 1.0 / 1.2 s on b; auto 1.0 / 0.8 and 1.2 / 1.0 s."""
    ar = [_runs("chat00", [1.0, 1.0]), _runs("code00", [1.0, 1.2])]
    auto = [_runs("chat00", [1.0, 0.8], ar_rounds=4), _runs("code00", [1.2, 1.0], ar_rounds=5)]
    rows = [{"mode": "ar", "temperature": 0.0, "records": ar}, {"mode": "auto", "temperature": 0.0, "records": auto}]
    for r in rows:
        tok, sec = sum(x["new_tokens"] for x in r["records"]), sum(x["seconds"] for x in r["records"])
        r["tokens_per_second"] = tok / sec
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / rows[0]["tokens_per_second"]
    return rows


def test_each_repeat_pairs_every_prompts_run_of_that_repeat_with_ar_s():
    ar, auto = (r["records"] for r in _rows())
    assert repeat_speedups(auto, ar) == pytest.approx([(20 / 2.2) / (20 / 2.0), (20 / 1.8) / (20 / 2.2)])
    assert repeat_speedups(ar, ar) == pytest.approx([1.0, 1.0])


def test_without_repeats_or_with_unequal_repeats_there_is_no_spread():
    ar = [_runs("a", [1.0])]
    assert "repeat_seconds" not in ar[0] and repeat_speedups([_runs("a", [2.0])], ar) is None
    assert repeat_speedups([_runs("a", [1.0, 1.0, 1.0])], [_runs("a", [1.0, 1.0])]) is None


def test_the_floor_line_shows_the_spread_over_repeats_and_the_worst_prompt_s_ar_rounds():
    rows = _rows()
    _worst(rows)
    code = (10 / 2.2) / (10 / 2.2)  # code00: auto 2.2 s, AR 2.2 s; chat00: 1.8 s against 2.0 s
    assert rows[1]["worst_vs_ar"] == {"id": "code00", "speedup_vs_ar": pytest.approx(code), "ar_rounds": 10,
                                      "rounds": 12}
    (line,) = floor_lines(rows)
    assert line == ("auto / AR at T = 0: 1.05x, per repeat 0.91-1.22x; worst prompt code00 1.00x "
                    "(AR in 10 of 12 rounds)")


def _with_control(control_seconds):
    """`_rows` plus the control row (AR again: 10 tokens a run) at T = 0, its seconds per prompt per repeat."""
    rows = _rows()
    control = {"mode": "ar (control)", "temperature": 0.0,
               "records": [_runs(pid, s, ar_rounds=6) for pid, s in control_seconds.items()]}
    tok, sec = sum(x["new_tokens"] for x in control["records"]), sum(x["seconds"] for x in control["records"])
    control["tokens_per_second"] = tok / sec
    control["speedup_vs_ar"] = control["tokens_per_second"] / rows[0]["tokens_per_second"]
    rows.insert(1, control)  # before auto's row: the line still follows auto's
    _worst(rows)
    return rows


def test_the_control_row_s_line_follows_auto_s_and_reads_as_ar_against_ar():
    """AR again, 1.0 / 1.0 s on chat00 and 1.2 / 1.2 s on code00 (AR's 4.2 s against 4.4): per repeat
    (20 / 2.2) / (20 / 2.0) and (20 / 2.2) / (20 / 2.2); its worst prompt code00 (2.2 s against 2.4), and
    no AR rounds named (every round of both rows is AR)."""
    rows = _with_control({"chat00": [1.0, 1.0], "code00": [1.2, 1.2]})
    auto_line, control_line = floor_lines(rows)
    assert auto_line.startswith("auto / AR at T = 0: 1.05x")
    assert control_line == ("control AR / AR at T = 0: 0.95x, per repeat 0.91-1.00x; worst prompt code00 0.92x")


def test_a_control_row_without_an_auto_row_still_has_its_line():
    rows = [r for r in _with_control({"chat00": [1.0, 1.0], "code00": [1.0, 1.2]}) if r["mode"] != "auto"]
    assert floor_lines(rows) == ["control AR / AR at T = 0: 1.00x, per repeat 1.00-1.00x; worst prompt chat00 1.00x"]

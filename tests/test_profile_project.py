"""`selfspec profile --project PROFILE` (`tools.projection`): f(width) beside the weights' bytes and
peak memory, and AR / linear / PRESTO tok/s projected from a replay profile's expected acceptance,
every projected figure labelled; and the analytic PRESTO tau it uses (`expected_tree_tau`)."""

import json
import math

import pytest

from selfspec.drafting.replay import Replay, ReplayProfile, load_profile
from selfspec.tools.cli import main
from matrix import FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: one thread (conftest)

LABEL = "projected from replayed acceptance (profile {}), synthetic weights"


def _project(capsys, *extra, weights="w4a8"):
    assert main(["profile", "--model", "synthetic:tiny", "--weights", weights, "--widths", "1", "2", "4", "8",
                 "--cache", "16", *extra]) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_the_command_prints_the_curve_bytes_memory_and_labelled_projections(capsys):
    out, rec = _project(capsys, "--project", "nld-8b")
    label = LABEL.format("nld-8b")
    for field in ("GB of weights read per forward", "peak memory (VmHWM):", "| width | 1 | 2 | 4 | 8 |", "| f ms |",
                  label, "| linear block 32 |", "| presto budget 64 |", "| ar |"):
        assert field in out, field
    assert rec["model"] == "synthetic:tiny" and rec["synthetic"] and rec["weights"].startswith("w4a8")
    assert rec["peak_memory_bytes"] > 0 and rec["label"] == label and rec["cache"] == 16
    # w4a8: every layer's matrices at 4 bits and their scales, the head at 8 bits (and its scales)
    from selfspec.checkpoint.synthetic import weight_bytes
    head = 4096 * 256
    layers = weight_bytes("synthetic:tiny", 1.0) - head
    assert 0.5 * layers + head <= rec["weight_bytes"] <= 0.7 * layers + 1.1 * head
    f = {int(w): ms / 1e3 for w, ms in rec["f_ms"].items()}
    assert sorted(f) == [1, 2, 4, 8] and all(v > 0 for v in f.values())
    proj = {p["layout"]: p for p in rec["projections"]}
    assert all(p["label"] == label for p in proj.values())
    assert proj["ar"]["tokens_per_second"] == pytest.approx(1 / f[1])
    prof = load_profile("nld-8b")
    lin = proj["linear block 8"]
    assert lin["tau"] == pytest.approx(prof.expected_tpf(7)) and lin["width"] == 8 and not lin["extrapolated"]
    assert lin["tokens_per_second"] == pytest.approx(lin["tau"] / f[8])
    assert lin["two_pass_tokens_per_second"] == pytest.approx(lin["tau"] / (2 * f[8]))  # draft pass + verify
    presto = proj["presto budget 32"]
    assert presto["tau"] == pytest.approx(prof.expected_tree_tau(32, 31)) and presto["width"] == 33
    assert presto["extrapolated"] and presto["one_pass_width"] == 33 + 33 * 32
    assert presto["tokens_per_second"] == pytest.approx(presto["tau"] * 1e3 / presto["f_ms"])


def test_the_projection_reads_the_profile_it_is_given(tmp_path, capsys):
    path = tmp_path / "half.json"
    path.write_text(json.dumps({"name": "half", "top1": [0.5], "rank2": [0.0]}))
    out, rec = _project(capsys, "--project", str(path))
    assert LABEL.format("half") in out
    proj = {p["layout"]: p for p in rec["projections"]}
    assert proj["linear block 8"]["tau"] == pytest.approx(2 - 0.5 ** 7)  # 1 + 1/2 + ... + 1/2^7
    assert proj["presto budget 8"]["tau"] == pytest.approx(2 - 0.5 ** 8)  # no second candidate: the chain


def test_a_bad_profile_fails_before_the_model_is_built(capsys):
    assert main(["profile", "--model", "synthetic:tiny", "--weights", "w4a8", "--project", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert "unknown replay profile" in err and "building" not in err


def test_expected_tree_tau_is_the_best_tree_of_its_budget():
    sure = ReplayProfile("sure", [1.0], [0.0])
    assert sure.expected_tree_tau(5) == 6 and sure.expected_tree_tau(64, max_depth=31) == 32  # a chain
    even = ReplayProfile("even", [0.5], [1.0])  # top-1 and second equally likely, nothing else
    assert even.expected_tree_tau(2) == pytest.approx(2.0)  # both children of the root
    assert even.expected_tree_tau(6) == pytest.approx(3.0)  # and all four grandchildren
    prof = load_profile("nld-8b")
    taus = [prof.expected_tree_tau(n) for n in (1, 8, 16, 32, 64)]
    assert taus == sorted(taus) and all(prof.expected_tree_tau(n) >= prof.expected_tpf(n) for n in (8, 16, 31))


def test_expected_tree_tau_matches_the_replayed_draws():
    """Walking the replayed draws (`Replay.outcome`) through the best 16-node tree commits what
    `expected_tree_tau` says, within 4 standard errors."""
    prof = ReplayProfile("mixed", [0.9, 0.4, 0.8, 0.7], [0.575, 0.5, 0.575, 0.575])
    rounds, nodes = 3000, 16
    import heapq

    def prob(path):
        return math.prod(prof.at(d)[0] if r == 0 else (1 - prof.at(d)[0]) * prof.at(d)[1]
                         for d, r in enumerate(path, 1))

    heap, tree = [(-prob((0,)), (0,)), (-prob((1,)), (1,))], set()
    while len(tree) < nodes:
        _, p = heapq.heappop(heap)
        tree.add(p)
        heap += [(-prob(p + (r,)), p + (r,)) for r in (0, 1)]
        heapq.heapify(heap)
    rep = Replay(prof, {0: [0] * (40 * rounds)}, {0: [1]}, mask_id=4, top_k=4)
    commits = []
    for start in range(0, 40 * rounds, 40):  # rounds 40 positions apart: no draw is shared
        path = ()
        while path + (rep.outcome(0, start + len(path), len(path) + 1),) in tree:
            path += (rep.outcome(0, start + len(path), len(path) + 1),)
        commits.append(len(path) + 1)
    mean = sum(commits) / len(commits)
    sd = math.sqrt(sum((c - mean) ** 2 for c in commits) / (len(commits) - 1))
    assert abs(mean - prof.expected_tree_tau(nodes)) <= 4 * sd / math.sqrt(len(commits))


@pytest.mark.parametrize("weights", FORMATS)
def test_every_weight_format_projects(capsys, weights):
    """The command is the same for every format a user can pick: curve, bytes and projections."""
    out, rec = _project(capsys, "--project", "nld-8b", weights=weights)
    assert rec["weights"].startswith(weights) and rec["weight_bytes"] > 0
    assert sorted(map(int, rec["f_ms"])) == [1, 2, 4, 8] and all(v > 0 for v in rec["f_ms"].values())
    assert [p["layout"] for p in rec["projections"]][:2] == ["ar", "linear block 8"]

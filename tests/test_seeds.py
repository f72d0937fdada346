"""Same seed, same tokens: with reproducible sampling (the default) the randomness of output
position t is Gumbel noise keyed by (seed, t), so every mode, the planner's choices, batches and
threads give AR's tokens for that seed, and each output is still an exact sample (the joint law
of the first tokens is the model's)."""

import math
import threading

import pytest
import torch

from selfspec.drafting.sampling import NEG, PositionNoise, process_logits, select
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder
from selfspec.engine.request.options import DecodeConfig

from conftest import tiny_model
from matrix import FORMATS
from test_sampled_exactness import chi2, critical

V = 8
MODES = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear two-pass": dict(mode="linear", schedule="two-pass"),
    "linear one-pass": dict(mode="linear", schedule="one-pass"),
    "presto two-pass": dict(mode="presto", schedule="two-pass", budget=8),
    "presto one-pass": dict(mode="presto", schedule="one-pass", budget=8, group_nodes=3),
    "auto": dict(mode="auto"),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, vocab_size=V)


def _prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(5, V, (n,), generator=g).tolist() for n in (6, 13, 4)]


def _run(model, prompts, seeds, mode, *, T=1.0, top_p=0.9, batch_size=None, new=24, clock=None):
    cfg = DecodeConfig(max_new_tokens=new, block_length=5, temperature=T, top_p=top_p, **MODES[mode])
    dec = Decoder(model, prompts, cfg, eos_token_id=[], seeds=seeds, batch_size=batch_size,
                  profile=clock if mode == "auto" else None)
    for _ in dec:
        pass
    return dec.outputs


@pytest.mark.parametrize("T", [0.7, 1.0])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "ar"])
def test_the_same_seed_gives_ars_tokens_in_every_mode_alone_and_in_a_batch(model, mode, T, monkeypatch):
    prompts, seeds = _prompts(), [11, 12, 13]
    ar = [_run(model, [p], [s], "ar", T=T)[0] for p, s in zip(prompts, seeds)]
    clock = None
    if mode == "auto":  # plans on a random clock: its layouts differ run to run, its tokens may not
        import random
        import types

        from selfspec.engine.round import step

        rng = random.Random(0)
        now = [0.0]
        monkeypatch.setattr(step, "time", types.SimpleNamespace(perf_counter=lambda: now.__setitem__(
            0, now[0] + rng.random() * 1e-2) or now[0]))
        clock = CostModel.linear(per_token=1e-3, fixed=1e-2)
    alone = [_run(model, [p], [s], mode, T=T, clock=clock)[0] for p, s in zip(prompts, seeds)]
    batch = _run(model, prompts, seeds, mode, T=T, batch_size=2, clock=clock)
    assert alone == ar and batch == ar
    assert _run(model, prompts[:1], [99], mode, T=T, clock=clock) != ar[:1]  # the seed matters


def test_eight_threads_sharing_the_model_give_each_its_own_seeds_tokens(model):
    prompts = _prompts()
    want = {(i, s): _run(model, [prompts[i % 3]], [s], "presto one-pass")[0] for i, s in enumerate(range(8))}
    got, errors = {}, []

    def work(i, s):
        try:
            got[i, s] = _run(model, [prompts[i % 3]], [s], "presto one-pass")[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=k) for k in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


def test_a_generator_maps_to_one_key_drawn_from_it():
    m = tiny_model(seed=2, vocab_size=V)
    p = _prompts()[0]
    cfg = DecodeConfig(max_new_tokens=16, temperature=1.0, mode="presto", schedule="one-pass", budget=6)

    def run(gen):
        d = Decoder(m, [p], cfg, eos_token_id=[], generators=[gen])
        for _ in d:
            pass
        return d.outputs[0]

    a, b = run(torch.Generator().manual_seed(3)), run(torch.Generator().manual_seed(3))
    assert a == b and run(torch.Generator().manual_seed(4)) != a


def test_position_noise_depends_on_the_key_and_the_position_only():
    a = PositionNoise(5, 64)
    first = a.at([3, 3, 4])
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    fresh = PositionNoise(5, 64)
    assert torch.equal(fresh.at([4])[0], first[2])  # nothing drawn before moves position 4
    assert not torch.equal(PositionNoise(6, 64).at([4])[0], first[2])


def test_the_draw_from_a_rows_candidates_is_the_draw_over_every_token():
    """`kernels.layer.gumbel_candidates` only narrows where the Gumbel-max draw looks: the same
    token as the noise over the whole vocabulary, at any temperature and filter, ties included."""
    from selfspec.kernels import layer as kl

    if not kl.available():
        pytest.skip("no C kernel here")
    g, Vb = torch.Generator().manual_seed(5), 4096
    for trial in range(200):
        n = (1, 2, 9)[trial % 3]
        logits = torch.randn(n, Vb, generator=g) * (1.0, 4.0, 12.0)[trial % 3]
        if trial % 7 == 0:
            logits[:, 10:20] = logits.max() + 1.0  # equal tops
        kw = dict(temperature=(0.6, 1.0, 1.7)[trial % 3], top_p=(1.0, 0.9)[trial % 2], top_k=(0, 0, 40)[trial % 3],
                  banned=3)
        noise, positions = PositionNoise(trial, Vb), [trial + i // 3 for i in range(n)]
        want = select(logits, noise=noise.at(positions), **kw)
        assert torch.equal(select(logits, noise=noise.rows(positions), candidates=kl.gumbel_candidates, **kw), want)
        assert torch.equal(select(logits, noise=noise.rows(positions), **kw), want)


def test_raw_logits_at_temperature_1_draw_from_candidates_without_a_copy_the_tokens_of_the_full_draw():
    """At T = 1 with nothing filtered, `select` hands the logits as they are (bf16 or float32, the
    banned token unmasked, here the largest) to the candidates' kernel, which reads the banned token
    as -inf: every row's token is the full draw's over `ban_token`'s float32 copy, never the banned."""
    from selfspec.kernels import layer as kl

    if not kl.available():
        pytest.skip("no C kernel here")
    g, V = torch.Generator().manual_seed(21), 4096
    for trial in range(60):
        n = (1, 3, 8)[trial % 3]
        logits = (torch.randn(n, V, generator=g) * (2.0, 6.0)[trial % 2]).to((torch.bfloat16, torch.float32)[trial % 2])
        logits[:, 3] = logits.max() + 5.0  # the banned token would win every row
        noise, positions = PositionNoise(trial, V), [trial + i // 2 for i in range(n)]
        want = select(logits, temperature=1.0, banned=3, noise=noise.at(positions))
        got = select(logits, temperature=1.0, banned=3, noise=noise.rows(positions), candidates=kl.gumbel_candidates)
        assert torch.equal(got, want) and 3 not in got.tolist(), trial


def test_rows_of_several_sequences_drawn_together_get_the_tokens_each_gets_alone():
    """`PositionNoise.rows_of`: the reproducible rows of several sequences (each its own key and
    positions, seeds in place of whole rows) in one
    Gumbel-max draw, a flat row among them, give every row the token of its own draw over the whole
    vocabulary, and each row the seed its sequence's `rows` gives it."""
    from selfspec.kernels import layer as kl

    g, V = torch.Generator().manual_seed(8), 4096
    fast = dict(fast=kl.uniforms) if kl.available() else {}
    for trial in range(40):
        seqs = [PositionNoise(100 * trial + k, V, **fast) for k in range(3)]
        positions = [[5, 6], [2], [9, 9, 10]]
        logits = torch.randn(6, V, generator=g) * (0.05 if trial % 4 == 0 else 6.0)  # some batches all flat
        logits[trial % 6] *= 0.01  # one flat row in every batch
        joined = PositionNoise.rows_of(seqs, positions)
        own = [PositionNoise(100 * trial + k, V, **fast).rows(p) for k, p in enumerate(positions)]
        assert torch.equal(joined.seeds[joined.rows], torch.cat([o.seeds[o.rows] for o in own]))
        got = select(logits, temperature=1.0, banned=3, noise=joined, candidates=kl.gumbel_candidates)
        alone = torch.cat([select(logits[a:b], temperature=1.0, banned=3, noise=n.at(p))
                           for n, p, (a, b) in zip(seqs, positions, [(0, 2), (2, 3), (3, 6)])])
        assert torch.equal(got, alone), trial


@pytest.mark.parametrize("mode", ["ar", "presto one-pass", "lookup"])
def test_decoders_sample_the_same_tokens_with_and_without_the_candidates(mode, monkeypatch):
    from selfspec.drafting import sampling as targets
    from selfspec.kernels import layer as kl

    big = tiny_model(seed=2, vocab_size=2048)  # room for candidates (at most 1/16 of the vocabulary)
    prompts, seeds = [[5, 9, 40, 7], [100, 3, 9]], [4, 5]
    real, taken = targets.gumbel_candidates, []

    def counted(*a, **kw):
        out = real(*a, **kw)
        if out is not None and out.flat is not None:  # several rows: each flat one declines alone
            taken.extend((~out.flat).tolist())
        else:
            taken.append(out is not None)
        return out

    monkeypatch.setattr(targets, "gumbel_candidates", counted)
    want = _run(big, prompts, seeds, mode, T=2.0, top_p=1.0, new=16)  # T = 2: some rows too flat for candidates
    if kl.available():  # both ways were taken: rows with candidates and rows too flat for them
        assert any(taken) and not all(taken)
    monkeypatch.setattr(targets, "gumbel_candidates", lambda *a, **kw: None)
    assert _run(big, prompts, seeds, mode, T=2.0, top_p=1.0, new=16) == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_every_weight_format_the_copy_free_draw_at_t1_is_the_full_draw(fmt, monkeypatch):
    """At T = 1 the candidates' kernel reads each format's logits as the head leaves them (float32
    in fp32, bf16 in the others) and every mode's tokens are the draw over the whole vocabulary's."""
    from selfspec.drafting import sampling as targets
    from selfspec.engine.measure.formats import set_weights
    from selfspec.kernels import layer as kl

    big = set_weights(tiny_model(seed=2, vocab_size=2048), fmt)
    prompts, seeds = [[5, 9, 40, 7], [100, 3, 9]], [4, 5]
    real, dtypes = targets.gumbel_candidates, set()

    def seen(x, *a, **kw):
        out = real(x, *a, **kw)
        if out is not None:
            dtypes.add(x.dtype)
        return out

    monkeypatch.setattr(targets, "gumbel_candidates", seen)
    got = {mode: _run(big, prompts, seeds, mode, T=1.0, top_p=1.0, new=16) for mode in ("ar", "presto one-pass", "lookup")}
    if kl.available():
        assert dtypes == {torch.float32 if fmt == "fp32" else torch.bfloat16}
    monkeypatch.setattr(targets, "gumbel_candidates", lambda *a, **kw: None)
    full = _run(big, prompts, seeds, "ar", T=1.0, top_p=1.0, new=16)
    assert all(out == full for out in got.values())


def _exact_joint(model, prompt, n, *, temperature, top_p) -> dict:
    """P(first n generated tokens) for every sequence that has probability, with the runtime's filtering."""
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n):
            prefixes = list(joint)
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
            probs = process_logits(logits, temperature=temperature, top_p=top_p,
                                   banned=model.config.mask_token_id).softmax(-1)
            joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(V)
                     if float(probs[i, t]) > 0}
    return joint


@pytest.mark.parametrize("mode", ["ar", "lookup", "presto one-pass", "presto two-pass"])
def test_the_first_three_tokens_follow_the_models_joint_law(model, mode):
    """Chi-square of the joint of the first three tokens against AR's exact law (p = 0.001); noise
    reused from one position to the next makes consecutive tokens depend on each other and fails
    it (checked with the key of position t made t // 2)."""
    prompt, n, N = [5, 6, 7, 5, 6], 3, 800
    exact = _exact_joint(model, prompt, n, temperature=1.0, top_p=0.9)
    outs = [tuple(o[:n]) for o in _run(model, [prompt] * N, list(range(N)), mode, new=n, batch_size=64)]
    cells = sorted(exact)
    seen = {c: 0 for c in cells}
    for o in outs:
        seen[o] = seen.get(o, 0) + 1
    assert set(seen) == set(cells), "a sequence the model never produces"
    counts = torch.tensor([float(seen[c]) for c in cells])
    stat, df = chi2(counts, torch.tensor([exact[c] for c in cells]), N)
    assert stat < critical(df), (mode, stat, df)
    assert not math.isinf(stat)


def test_processed_logits_at_temperature_one_are_the_logits_bit_for_bit_and_the_callers_stay_intact():
    """At T = 1 the division is skipped (a row's copy saved per sampled token): the result must be
    what dividing by 1.0 gives, -inf, NaN and subnormals included, with the banned token at NEG,
    and the caller's logits untouched."""
    for dtype in (torch.float32, torch.bfloat16):  # bf16's float32 copy is the one the ban writes to
        logits = torch.tensor([[0.5, -float("inf"), 3e-45, -2.25, float("nan"), 7.0, 1e30, -0.0]]).to(dtype)
        before = logits.clone()
        for banned in (None, 5):
            got = process_logits(logits, temperature=1.0, banned=banned)
            want = process_logits(logits, temperature=0.0, banned=banned) / 1.0
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
            assert banned is None or got[0, 5] == NEG
        assert torch.equal(logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))

import math

import torch

from selfspec.drafting.scoring import NgramRho


def _brute(ctx, V, a, b, t):
    L = len(ctx)
    c1 = ctx.count(t)
    p1 = (c1 + 1) / (L + V)
    c2 = sum(1 for i in range(L - 1) if ctx[i] == b and ctx[i + 1] == t)
    h1 = sum(1 for i in range(L - 1) if ctx[i] == b)
    p2 = (c2 + p1) / (h1 + 1)
    c3 = sum(1 for i in range(L - 2) if ctx[i : i + 3] == [a, b, t])
    h2 = sum(1 for i in range(L - 2) if ctx[i : i + 2] == [a, b])
    return (c3 + p2) / (h2 + 1)


def test_ngram_rho_matches_brute_force_counts():
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 6, (80,), generator=g).tolist()
    rho = NgramRho(6, ctx)
    a, b, t = torch.meshgrid(torch.arange(6), torch.arange(6), torch.arange(6), indexing="ij")
    got = rho(a.reshape(-1), b.reshape(-1), t.reshape(-1)).exp()
    for i, (x, y, z) in enumerate(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), t.reshape(-1).tolist())):
        assert math.isclose(float(got[i]), _brute(ctx, 6, x, y, z), rel_tol=1e-5)


def test_ngram_rho_fed_token_by_token_and_read_between_scores_as_one_built_over_the_whole_context():
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 6, (60,), generator=g).tolist()
    rho = NgramRho(6, ctx[:20])
    q = [torch.randint(0, 6, (50,), generator=g) for _ in range(3)]
    for i in range(20, 60):
        rho.extend([ctx[i]] if i % 3 else torch.tensor([ctx[i]]))
        if i % 7 == 0:
            assert torch.equal(rho(*q), NgramRho(6, ctx[: i + 1])(*q))
    assert torch.equal(rho(*q), NgramRho(6, ctx)(*q))


def test_ngram_rho_is_a_log_probability_and_prefers_seen_continuations():
    rho = NgramRho(100, [5, 6, 7, 5, 6])
    seen = rho(torch.tensor([5]), torch.tensor([6]), torch.tensor([7]))
    unseen = rho(torch.tensor([5]), torch.tensor([6]), torch.tensor([42]))
    assert float(seen) <= 0 and float(seen) > math.log(0.5) - 1e-6
    assert float(unseen) < float(seen)
    rho.extend([7])
    assert float(rho(torch.tensor([5]), torch.tensor([6]), torch.tensor([7]))) > float(seen)

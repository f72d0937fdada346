"""Sampling, target selection and verification: pure functions over explicit randomness.

The verifier never compares probabilities: at each visited node it *draws* the target's token
(argmax at temperature 0) and accepts a draft token only if it equals that draw, so every
emitted token is an exact sample of the model in every mode.

Two sources of randomness:

* reproducible (the default): `PositionNoise`, Gumbel noise keyed by (key, output position).
  The token at output position t is argmax(filtered logits_t / T + g_t): a Gumbel-max draw,
  an exact sample of softmax(filtered logits_t / T) because g_t is independent of everything
  that decided the prefix. Every node of a tree at depth d stands for the same position, so it
  uses the same g_t; nothing a round does moves the noise of any position, so the same key gives
  the same tokens whatever the layout, the batch or the thread, and AR's tokens;
* independent: one draw per node from the row's `torch.Generator` (the order of draws follows
  the layouts, so a seed reproduces a run only with the same layouts).
"""

from __future__ import annotations

import torch

from selfspec.kernels.layer import argmax, gumbel_candidates

NEG = float("-inf")


def ban_token(logits: torch.Tensor, banned: int | None) -> torch.Tensor:
    """Float32 logits with `banned` (the mask id) at -inf: a token that is never produced nor drafted.

    A copy whenever it changes anything, so the caller's logits stay intact (bf16 logits' float32
    copy is that copy: no second one).
    """
    x = logits.float()
    if banned is not None:
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        x[..., banned] = NEG
    return x


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   banned: int | None = None) -> torch.Tensor:
    """Logits [..., V] -> filtered, temperature-scaled float32 logits (HF semantics); at T = 1
    with nothing banned or filtered, the float32 logits themselves (callers never write to it).

    `banned` (the mask id) can never be produced. Temperature 0 returns the raw logits (argmax).
    """
    x = ban_token(logits, banned)
    if temperature == 0:
        return x
    if temperature != 1.0:  # x / 1.0 is x, bit for bit: a copy of the row saved per sampled token
        x = x / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), NEG)
    return x


def select(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           banned: int | None = None, generator: torch.Generator | None = None,
           noise: "torch.Tensor | NoiseRows | None" = None, candidates=None) -> torch.Tensor:
    """One target token per row of `logits` [n, V]: argmax at T=0; else with `noise` (each row's
    position's Gumbel noise [n, V], or the uniforms it is made of, `NoiseRows`) the Gumbel-max draw
    (`candidates`: see `gumbel_argmax`), else an independent sample."""
    if isinstance(noise, NoiseRows) and candidates is not None and temperature == 1.0 and not top_k and top_p >= 1.0:
        return gumbel_argmax(logits, noise, candidates, banned=banned)  # nothing to temper or filter: no copy
    x = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, banned=banned)
    if temperature == 0:
        return x.argmax(-1)
    if isinstance(noise, NoiseRows):
        return gumbel_argmax(x, noise, candidates)
    if noise is not None:
        return (x.double() + noise.to(x.device)).argmax(-1)
    # inverse-CDF draw: the first token whose cumulative probability exceeds u ~ U[0, total).
    # Exactly the categorical distribution, and ~10x cheaper than torch.multinomial for one draw
    # per row (which dominated a CPU round's sampling time).
    cdf = x.softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return idx.clamp_(max=cdf.shape[-1] - 1)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of float64 uniforms, elementwise (torch's vectorised log: an
    element's bits do not depend on the tensor it is in)."""
    return u.log().neg_().log_().neg_()


class NoiseRows:
    """The uniforms behind n rows' Gumbel noise: `rows` [n] (each row's position among p distinct
    ones) and the positions' `seeds` [p] (int64 bit patterns of `splitmix_uniforms`' seeds). A position's
    uniforms are made whole (`u` [p, V] float64; `make_row(seed)` makes one) only when read that
    way; a draw from candidates reads a few (`kernels.layer.gumbel_candidates` makes them)."""

    def __init__(self, seeds: torch.Tensor, rows: torch.Tensor, make_row, whole: torch.Tensor | None = None):
        self.seeds, self.rows = seeds, rows
        self.make_row, self.whole = make_row, whole

    @property
    def u(self) -> torch.Tensor:
        if self.whole is None:
            self.whole = torch.stack([self.make_row(s) for s in self.seeds.tolist()])
        return self.whole

    def only(self, i: int) -> "NoiseRows":
        """Row i's noise alone: its position, one row."""
        p = int(self.rows[i])
        return NoiseRows(self.seeds[p : p + 1], torch.zeros(1, dtype=torch.long), self.make_row,
                         None if self.whole is None else self.whole[p : p + 1])


def gumbel_argmax(x: torch.Tensor, noise: NoiseRows, candidates=None, banned: int | None = None) -> torch.Tensor:
    """(x.double() + gumbel(noise.u[noise.rows])).argmax(-1) for float32 logits x [n, V] (or, with
    `banned`, logits of any float dtype and the token never drawn: `ban_token(x, banned)`, the copy
    made only where the whole vocabulary is drawn from): the same
    tokens (the first of equal maxima), with the noise made only where it can win when
    `candidates(x, u, rows, seeds)` names those tokens (`kernels.layer.gumbel_candidates`: (row,
    token) pairs in index order, a superset of each row's winner, with their logits as float64 and
    their uniforms; u None: the seeds' uniforms; `flat`, the rows that declined, draw alone), else
    over every token.

    Why a few suffice: row i's top logit x_j with its noise is a value the winner reaches, lb =
    x_j + g_j, and a token k wins only if x_k + g_k >= lb. The kernel tests that for the tokens of
    the blocks whose largest logit reaches lb with the block's largest noise, and those only where
    x_k >= lb - top (`top`, the position's largest noise). At temperature 1 a median of 1 of the
    default model's 49,152 tokens is left a row (~140 passed x_k >= lb - top alone), and the two
    float64 logs over the vocabulary (with the full row's add and argmax, what had made a sampled
    token dearer than a greedy one on a CPU) become that many.

    Example: x = [[0, 5, 4]], noise [0.3, 0.1, 2.0] (top 2.0): lb = 5.1; x >= 3.1 for tokens 1
    and 2, whose values 5.1 and 6.0 both reach lb: they are the candidates -> token 2."""
    n, V = x.shape
    rows = noise.rows.to(x.device)
    pairs, flat = None, None
    if candidates is not None:
        whole = None if noise.whole is None else noise.whole.to(x.device)
        pairs = (candidates(x, whole, rows, noise.seeds, banned=banned) if n == 1 else
                 candidates(x, whole, rows, noise.seeds, flat=True, banned=banned))
    if pairs is None:
        if candidates is not None and (banned is not None or x.dtype != torch.float32):  # e.g. fp16: its
            return gumbel_argmax(ban_token(x, banned), noise, candidates)  # float32 copy may take candidates
        return (x.double() + gumbel(noise.u.to(x.device)[rows])).argmax(-1)
    r, c, flat = pairs.rows, pairs.tokens, pairs.flat  # flat: rows too flat for candidates (they have none)
    if len(c) == n and (n == 1 or bool((r == torch.arange(n, device=r.device)).all())):  # (a flat row has none)
        return c.clone()  # one candidate a row (at T = 1 the median row's): the winner, whatever its noise
    v = pairs.logits + gumbel(pairs.uniforms)  # x[r, c].double() + the pairs' noise
    if n == 1:  # candidates in index order: argmax's first maximum is the first token's
        return c[v.argmax()].reshape(1)
    best = torch.full((n,), NEG, dtype=torch.float64, device=x.device).scatter_reduce(0, r, v, "amax")
    first = torch.where(v == best[r], c, torch.full_like(c, V))
    out = torch.full((n,), V, dtype=torch.long, device=x.device).scatter_reduce(0, r, first, "amin")
    if flat is not None and bool(flat.any()):
        for i in flat.nonzero().flatten().tolist():
            out[i] = gumbel_argmax(ban_token(x[i : i + 1], banned), noise.only(i))[0]
    return out


MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:  # logical shift right of int64 bit patterns
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix_uniforms(seed: int, V: int) -> torch.Tensor:
    """V float64 uniforms in (0, 1) from a 64-bit seed: u_i = ((z_i >> 11) + 0.5) 2^-53 with z_i =
    splitmix64(seed + (i + 1) 0x9E3779B97F4A7C15) (int64 arithmetic wraps as uint64's does).
    Counter-based: u_i depends on (seed, i) alone, and `kernels.layer.uniforms` makes the same bits
    in one C pass. Never 0 or 1, so every Gumbel noise is finite.

    Example: splitmix_uniforms(0, 2) -> z_0 = splitmix64(0x9E3779B97F4A7C15) = 0xE220A8397B1DCDAF,
    u_0 = ((z_0 >> 11) + 0.5) / 2^53 = 0.88331..."""
    z = torch.arange(1, V + 1, dtype=torch.int64) * _i64(0x9E3779B97F4A7C15) + _i64(seed & MASK64)
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    z = z ^ _srl(z, 31)
    return (_srl(z, 11).double() + 0.5) * 2.0**-53


def mix(*words: int) -> int:
    """A 63-bit key from integers (splitmix64 finalizer over their running combination)."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & MASK64
        h ^= h >> 29
    return h >> 1


class PositionNoise:
    """Gumbel noise per output position, from a key: g_t = -log(-log(u)) with u uniform in (0, 1),
    `splitmix_uniforms` of the seed mix(key, t, purpose). Position t's noise depends on nothing but
    (key, t): draw order, layouts, batches and threads cannot move it. Positions are cached until
    `forget_before` drops them. `fast` makes a position's row of uniforms in C
    (`kernels.layer.uniforms`; None, or returning None: torch's); a draw from candidates never makes
    it (their kernel makes the uniforms it reads from the positions' seeds).

    Example: PositionNoise(5, 8).at([3, 3, 4]) gives rows 0 and 1 equal (one position) and row 2
    another; PositionNoise(5, 8).at([4]) equals that row 2 in a fresh object."""

    TARGET = 1  # purpose of the noise the target draws use (more purposes may come)

    def __init__(self, key: int, vocab: int, fast=None):
        self.key, self.vocab = int(key), int(vocab)
        self.fast = fast
        self._u: dict[int, torch.Tensor] = {}  # position -> its uniforms [V] float64, made when read whole
        self._g: dict[int, torch.Tensor] = {}  # position -> its noise [V], made when a whole row is read

    def _row(self, t: int) -> torch.Tensor:
        u = self._u.get(t)
        if u is None:
            u = self._u[t] = self._seed_row(mix(self.key, t, self.TARGET))
        return u

    def at(self, positions: list[int]) -> torch.Tensor:
        """[len(positions), V] float64 noise."""
        rows = []
        for t in positions:
            g = self._g.get(t)
            if g is None:
                g = self._g[t] = gumbel(self._row(t))
            rows.append(g)
        return torch.stack(rows)

    def rows(self, positions: list[int]) -> NoiseRows:
        """The uniforms of these positions' noise, for `gumbel_argmax` (the same draws as `at`'s)."""
        return PositionNoise.rows_of([self], [positions])

    @staticmethod
    def rows_of(noises: list["PositionNoise"], positions: list[list[int]]) -> NoiseRows:
        """Several sequences' rows as one `NoiseRows` (each one's `rows` side by side, each
        sequence's positions its own)."""
        seeds, rows, wholes = [], [], []
        for noise, ts in zip(noises, positions):
            index: dict = {}
            for t in ts:
                if t not in index:
                    index[t] = len(seeds)
                    seeds.append(_i64(mix(noise.key, t, noise.TARGET)))
                    wholes.append(noise._u.get(t))
                rows.append(index[t])
        first = noises[0]
        whole = torch.stack(wholes) if all(w is not None for w in wholes) else None
        return NoiseRows(torch.tensor(seeds, dtype=torch.int64), torch.tensor(rows), first._seed_row, whole)

    def _seed_row(self, seed: int) -> torch.Tensor:
        """The uniforms [V] of a seed (its int64 bits)."""
        u = None if self.fast is None else self.fast(seed, self.vocab)
        return splitmix_uniforms(seed, self.vocab) if u is None else u

    def forget_before(self, position: int) -> None:
        for cache in (self._u, self._g):
            for t in [t for t in cache if t < position]:
                del cache[t]


# -- a round's targets: every row's token after the forward's logits ----------------------------------
def targets_of(parts: list[tuple], mask_id: int) -> list[torch.Tensor]:
    """For each (seq, logits [n, V], its n output positions): the target's token after each row,
    `mask_id` never drawn. Greedy rows of every sequence go through one argmax (bf16 rows in one
    C pass); the reproducible rows of each temperature and filter through one Gumbel-max draw,
    their noise side by side (`PositionNoise.rows_of`: each sequence's own keyed positions); an
    independent draw reads its sequence's generator, so those go one sequence at a time. Every
    step is row by row, so each row's token is the one it gets alone.

    Example: three sequences, the first and last greedy, the middle one reproducible at T = 1:
    one argmax over the first and last ones' rows, one draw over the middle one's."""
    groups: dict[tuple, list[int]] = {}
    for i, (seq, _, _) in enumerate(parts):
        p = seq.params
        key = (("greedy",) if p.temperature == 0 else
               ("noise", p.temperature, p.top_k, p.top_p) if seq.noise is not None else ("own", i))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(parts)
    for key, idx in groups.items():
        logits = _stacked([parts[i][1] for i in idx])
        if key[0] == "greedy":
            got = argmax(logits, mask_id).cpu()
        else:
            seq = parts[idx[0]][0]
            p = seq.params
            rand = ({"generator": seq.gen} if key[0] == "own" else
                    {"noise": PositionNoise.rows_of([parts[i][0].noise for i in idx], [parts[i][2] for i in idx])})
            got = select(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, banned=mask_id,
                         candidates=gumbel_candidates, **rand).cpu()
        at = 0
        for i in idx:
            n = parts[i][1].shape[0]
            out[i], at = got[at : at + n], at + n
    return out


def _stacked(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Row blocks [n_i, V] as one [sum n_i, V]: a view where they lie end to end in one tensor (a
    round's rows, sliced in order from its logits), else a copy."""
    first = blocks[0]
    if len(blocks) == 1:
        return first
    size = first.element_size()
    if all(b.is_contiguous() and b.shape[1:] == first.shape[1:] for b in blocks) and all(
            b.data_ptr() == a.data_ptr() + a.numel() * size for a, b in zip(blocks, blocks[1:])):
        return first.as_strided((sum(b.shape[0] for b in blocks), *first.shape[1:]), first.stride())
    return torch.cat(blocks)


# -- verification: the path the targets accept, and what is emitted -----------------------------------
def walk(tree, targets: torch.Tensor) -> tuple[list[int], int]:
    """Accepted node path (root first) and the bonus token of a `tree.Tree` whose node v's target
    token (argmax, or one draw per node) is `targets[v]`: from the root, a child is accepted iff it
    carries its parent's target token; the last accepted node's target is the bonus. The draw at a
    node does not depend on whether the walk reaches it, so the emitted tokens are exact samples.

    Example: tokens [7, 11, 12, 13], parents [-1, 0, 0, 1], targets [12, 5, 9, 4]:
    root 7 -> target 12 -> child node 2 carries 12, accepted -> its target 9 matches no child,
    so the path is [0, 2] and the bonus is 9 (two tokens emitted: 12, 9).
    """
    if tree.tokens.shape[0] == 1:  # the root alone (every AR round): its target is the bonus
        return [0], int(targets[0])
    tok, par, tgt = tree.tokens.tolist(), tree.parents.tolist(), targets.tolist()
    children: dict[int, dict[int, int]] = {}
    for v in range(1, len(tok)):
        children.setdefault(par[v], {}).setdefault(tok[v], v)
    path = [0]
    while True:
        nxt = children.get(path[-1], {}).get(tgt[path[-1]])
        if nxt is None:
            return path, tgt[path[-1]]
        path.append(nxt)


def oracle_length(candidates: torch.Tensor, continuation: list[int]) -> int:
    """Tokens a perfect tree inside the candidate space would commit in that round.

    candidates [D, K]: the top-k draft tokens per depth; continuation: the tokens actually
    emitted after the root (from this round on). The oracle accepts depth d while the emitted
    token there is among the candidates, then adds the bonus.
    Example: candidates [[3, 4], [5, 6]], continuation [4, 9, 1] -> depth 1 ok, depth 2 fails
    -> 1 accepted + bonus = 2.
    """
    n = 0
    for d in range(min(candidates.shape[0], len(continuation))):
        if continuation[d] not in candidates[d].tolist():
            break
        n += 1
    return min(n + 1, max(len(continuation), 1))


def truncate(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """A round's committed tokens cut at the first eos (kept) and at `room`; (chunk, hit eos).

    Example: truncate([5, 2, 7], eos={2}, room=8) -> ([5, 2], True); truncate([5, 6, 7], {2}, 2) -> ([5, 6], False).
    """
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in eos:
            return out, True
    return out, False

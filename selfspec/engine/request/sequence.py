"""One request's state inside the decoder (nano-vllm's `Sequence`), and what it drafts from it.

A `Sequence` holds everything that belongs to one prompt and nothing that belongs to the batch:
its prompt, sampling parameters and generator, its text so far, its lookup index and n-gram rho
(both fed by every emitted token), the root and marginals the next round starts from, its stats
and pending oracle candidates. It is the only owner of these: the decoder keeps its sequences by
index (`engine.decoder.Decoder`) and reads `outputs`, `stats`, ... from them (`ByIndex`); a
generation of one prompt is the same code with one.

Each sequence samples with its own `SamplingParams` (a server's requests differ in
max_new_tokens, temperature, top-k and top-p while sharing one batch).

The drafting helpers turn a sequence plus marginals into the tree a round verifies
(`draft_tree`) or read its context for a copied chain (`lookup_chain`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from selfspec.drafting.lookup import ContextIndex
from selfspec.drafting.sampling import PositionNoise, oracle_length, truncate
from selfspec.drafting.scoring import NgramRho, make_extra_score, path_context
from selfspec.drafting.tree import ContextCandidates, Marginals, Tree, build_tree, chain, root_only
from selfspec.engine.request.options import DecodeConfig, check_sampling
from selfspec.engine.request.stats import Stats
from selfspec.kernels.layer import uniforms


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence samples (HF names and meanings); checked at construction."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        check_sampling(self)

    @classmethod
    def of(cls, cfg: DecodeConfig) -> "SamplingParams":
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)


@dataclass(eq=False)
class Sequence:
    """One prompt's generation. `emitted` and `stats` are the objects the caller reads."""

    index: int  # the prompt's place in the input
    prompt: list[int]
    gen: torch.Generator | None
    params: SamplingParams = field(default_factory=SamplingParams)
    stats: Stats = field(default_factory=Stats)
    emitted: list[int] = field(default_factory=list)
    lookup: ContextIndex | None = None  # prompt lookup over prompt + emitted
    rho: NgramRho | None = None  # n-gram rho over prompt + emitted
    extra: object = None  # the tree builder's extra score (lambda * log rho), or None
    root: int = -1  # the last emitted token, not in the cache yet
    marg: Marginals | None = None  # marginals the previous round left (one-pass), or None
    match: int = 1  # n-gram length behind the latest lookup proposal
    lookup_run: int = 0  # the latest lookup chains (verified or followed in hindsight) its tokens bore out whole
    done: bool = False
    cancelled: bool = False
    t0: float = field(default_factory=time.perf_counter)
    pending_oracle: list = field(default_factory=list)  # (emitted before the round, candidates [D, K])
    noise: PositionNoise | None = None  # sampling "reproducible": Gumbel noise per output position

    def tail(self, n: int) -> list[int]:
        """The last n committed tokens (the root is the last), without copying the whole text."""
        e = self.emitted
        return e[-n:] if len(e) >= n else self.prompt[len(self.prompt) - (n - len(e)):] + e

    @property
    def room(self) -> int:
        """Tokens the sequence may still emit."""
        return self.params.max_new_tokens - len(self.emitted)

    def emit(self, tokens: list[int], eos: set[int]) -> list[int]:
        """Truncate at eos (inclusive) and at max_new_tokens; feeds rho and the lookup index and
        marks the sequence done. Returns the chunk that was emitted."""
        max_new_tokens = self.params.max_new_tokens
        out, hit = truncate(tokens, eos, max_new_tokens - len(self.emitted))
        self.done = self.done or hit or len(self.emitted) + len(out) >= max_new_tokens
        self.emitted.extend(out)
        self.stats.new_tokens = len(self.emitted)
        if self.rho is not None and out:
            self.rho.extend(out)
        if self.lookup is not None and out:
            self.lookup.extend(out)
        if self.noise is not None:
            self.noise.forget_before(len(self.emitted) - 1)
        if self.done:
            self.finish()
        return out

    def finish(self) -> None:
        """Wall time and oracle lengths, once (when the sequence ends or its iteration stops)."""
        if self.stats.seconds == 0.0:
            self.stats.seconds = time.perf_counter() - self.t0
        for start, cand in self.pending_oracle:
            if start < len(self.emitted):
                self.stats.oracle_lengths.append(oracle_length(cand, self.emitted[start:]))
        self.pending_oracle.clear()


def seeded(seed: int, device) -> torch.Generator:
    """A sequence's generator from its seed (the same seed gives the same tokens)."""
    return torch.Generator(device=device).manual_seed(int(seed))


def prepare(seq: Sequence, model, cfg: DecodeConfig, *, lookup: bool) -> Sequence:
    """A sequence made ready to run as it is queued: the per-request scorers its mode reads (PRESTO
    trees (presto, auto) get the n-gram rho, or the learned predictor over it; `lookup` asks for a
    prompt-lookup index), its sampling noise (the key is drawn from its generator now, when it
    enters, as it always was) and its clock started (`stats.seconds` counts from its queueing,
    not from when the decoder was built)."""
    prompt = seq.prompt
    if cfg.sampling == "reproducible":
        seq.noise = PositionNoise(_key_from(seq.gen), model.config.vocab_size, fast=uniforms)
    trees = cfg.mode in ("presto", "auto")
    if trees and cfg.rho in ("ngram", "learned"):
        seq.rho = NgramRho(model.config.vocab_size, prompt)
    if trees and cfg.rho == "learned":
        from selfspec.drafting.learned_rho import LearnedRho

        seq.extra = make_extra_score(LearnedRho(model.presto_predictor, seq.rho), cfg.lam)
    elif trees:
        seq.extra = make_extra_score(seq.rho, cfg.lam)
    if lookup:
        seq.lookup = ContextIndex(prompt, min_ngram=cfg.lookup_min_ngram, max_ngram=cfg.lookup_max_ngram)
    seq.t0 = time.perf_counter()
    return seq


def _key_from(gen: torch.Generator | None) -> int:
    """A sequence's noise key: one draw from its generator (so seed=s and a generator seeded with
    s are the same), or from torch's global RNG (no seed: not reproducible)."""
    if gen is None:
        return int(torch.randint(0, 2**62, (1,)))
    return int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))


def draft_tree(seq: Sequence, cfg: DecodeConfig, marg: Marginals | None, nodes: int, room: int, *,
               linear: bool) -> Tree:
    """Marginals -> the tree a round verifies: the root alone (no marginals, no room), a chain of
    the top-1 tokens (linear), or PRESTO's top-`nodes` tree with context candidates. With
    reproducible sampling the marginals are coupled to the target's noise first
    (`Marginals.coupled`): depth d stands for output position len(emitted) - 1 + d."""
    if nodes < 1 or marg is None or room <= 1:
        return root_only(seq.root)
    p = seq.params
    if seq.noise is not None and p.temperature > 0 and marg.logq is not None:
        e = len(seq.emitted)
        marg = marg.coupled(seq.noise.at([e - 1 + d for d in range(1, len(marg) + 1)]), cfg.tree_top_k,
                            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
    depth = min(len(marg), room - 1)
    if linear:
        lq, tok = marg.top_lq[:depth, 0], marg.top_tok[:depth, 0]
        return chain([seq.root] + tok.tolist(), torch.cat([torch.zeros(1), lq.cumsum(0)]))
    tail = seq.tail(max(2, cfg.lookup_max_ngram))
    h2 = path_context(tail, [], 2)[0]
    ctx = None
    if cfg.lookup and seq.lookup is not None and marg.logq is not None:
        index = seq.lookup
        ctx = ContextCandidates(lambda path: index.continuations(path, 2), marg.logq,
                                tuple(tail[-cfg.lookup_max_ngram:]))
    k = cfg.tree_top_k
    return build_tree(seq.root, marg.top_lq[:, :k], marg.top_tok[:, :k], budget=nodes, extra_score=seq.extra,
                      history=(h2, seq.root), max_depth=depth, entropy=marg.entropy, lookup=ctx)


def lookup_chain(seq: Sequence, cfg: DecodeConfig, room: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest match of the context's last n-gram
    (`seq.match` is set to that n-gram's length, even when there is no room to draft)."""
    tail = seq.tail(cfg.lookup_max_ngram)
    seq.match = seq.lookup.match_length(tail)
    return seq.lookup.propose(tail, min(cfg.lookup_tokens, room - 1)) if room > 1 else []


class ByIndex(list):
    """One field of a decoder's sequences, read-only, keyed by sequence index (`Sequence.index`: a
    batch's input order, then the order of `Decoder.add`) and taken when asked for: `x[i]` is
    sequence i's (a KeyError once `Decoder.forget` dropped it). As a list it holds the values of
    the sequences not forgotten, in index order, so a batch's `outputs == [...]`, iteration, `len`
    and JSON behave as a list's. The values are the sequences' own objects (`outputs[i]` is
    sequence i's `emitted`, growing as it runs); the container is a snapshot that refuses edits:
    a sequence's state is changed through the sequence, nowhere else."""

    __slots__ = ("_keys",)

    def __init__(self, by_index: dict[int, object]):
        super().__init__(by_index.values())
        self._keys = list(by_index)  # sequence index of each value, increasing

    def _pos(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"a sequence index is an int, not {type(i).__name__}")
        keys = self._keys
        p = i if 0 <= i < len(keys) and keys[i] == i else bisect_left(keys, i)  # nothing forgotten before i: p = i
        if p == len(keys) or keys[p] != i:
            raise KeyError(f"no sequence {i} (never added, or forgotten)")
        return p

    def __getitem__(self, i):
        if isinstance(i, slice):  # by position, like the list it is
            return list.__getitem__(self, i)
        return list.__getitem__(self, self._pos(i))

    def indices(self) -> list[int]:
        return list(self._keys)

    def _refuse(self, *a, **k):
        raise TypeError("a decoder's per-sequence view is read-only: change the sequence itself")

    __setitem__ = __delitem__ = append = extend = insert = pop = remove = sort = reverse = clear = _refuse
    __iadd__ = __imul__ = _refuse

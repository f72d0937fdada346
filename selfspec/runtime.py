"""The decoding engine: AR, linear and PRESTO drafts under the two-pass or one-pass schedule.

Every round starts from the same state: the KV cache holds the accepted prefix (length c) and
`root`, the last emitted token, is not in the cache yet. A drafter turns diffusion marginals
into a tree rooted at `root` (AR: the root alone; linear: a chain; PRESTO: a tree). The
schedule lays out the forward(s) with pure mask builders (`masks.tree_and_groups`,
`masks.draft_block`), the verifier walks the tree (`verify.walk`), and the cache keeps the
accepted path (`cache.commit`). Emitted per round: the accepted draft nodes plus the bonus.

two-pass: draft forward over [root, M x (B-1)] (cache read-only), then a tree-verify forward.
one-pass: one forward over [tree | a mask group per node]; the accepted endpoint's group gives
          the next round's marginals (its first slot is the bonus position, filled exactly).
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from . import cache as kv
from .config import DecodeConfig
from .masks import draft_block, tree_and_groups
from .sampling import draft_logprobs, select
from .scoring import NgramRho, make_extra_score
from .tree import Tree, build_tree, chain, group_owners, nearest_owner, root_only
from .verify import oracle_length, walk


@dataclass
class Stats:
    """Measurements of one generation (returned as a value, never printed)."""

    new_tokens: int = 0
    rounds: int = 0
    forwards: int = 0  # decode forwards, prefill excluded (two-pass counts both passes)
    prefill_forwards: int = 0
    round_tokens: int = 0  # tokens committed by verification rounds (prefill's first token excluded)
    accept_lengths: list[int] = field(default_factory=list)
    oracle_lengths: list[int] = field(default_factory=list)
    forward_seconds: float = 0.0
    tree_seconds: float = 0.0  # drafting: turning marginals into the chain / tree
    seconds: float = 0.0
    query_tokens: int = 0  # query tokens run by decode forwards (tree nodes + mask slots)

    @property
    def tau(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def tpf(self) -> float:
        return self.round_tokens / self.forwards if self.forwards else 0.0

    @property
    def oracle_tau(self) -> float | None:
        return sum(self.oracle_lengths) / len(self.oracle_lengths) if self.oracle_lengths else None

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "forwards": self.forwards,
            "query_tokens": self.query_tokens,
            "prefill_forwards": self.prefill_forwards,
            "tau": round(self.tau, 4),
            "tpf": round(self.tpf, 4),
            "oracle_tau": None if self.oracle_tau is None else round(self.oracle_tau, 4),
            "accept_hist": dict(sorted(Counter(self.accept_lengths).items())),
            "seconds": round(self.seconds, 4),
            "forward_seconds": round(self.forward_seconds, 4),
            "other_seconds": round(self.seconds - self.forward_seconds, 4),
            "tree_seconds": round(self.tree_seconds, 4),
            "overhead_share": round(1 - self.forward_seconds / self.seconds, 4) if self.seconds else 0.0,
            "tokens_per_second": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0,
        }


def check_request(model, prompt_ids, cfg: DecodeConfig) -> None:
    """Every request error, raised before any model work."""
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    limit = model.config.max_position_embeddings
    need = len(prompt_ids) + cfg.max_new_tokens + (0 if cfg.mode == "ar" else max(cfg.block_length, cfg.group))
    if need > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) + draft lookahead "
            f"needs {need} positions; the model has max_position_embeddings={limit}"
        )
    if cfg.mode == "presto" and cfg.rho == "learned" and getattr(model, "presto_predictor", None) is None:
        raise ValueError("rho 'learned' needs a trained predictor (presto_predictor.safetensors next to the model; "
                         "make one with `python -m selfspec.predictor collect/train`); none is loaded")


class Decoder:
    """Runs one generation as an iterator of committed token chunks; `stats` fills as it goes."""

    def __init__(self, model, prompt_ids, cfg: DecodeConfig, *, eos_token_id=None,
                 generator: torch.Generator | None = None):
        check_request(model, prompt_ids, cfg)
        self.model, self.cfg = model, cfg
        self.prompt = [int(t) for t in prompt_ids]
        eos = eos_token_id if eos_token_id is not None else model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.mask_id = int(model.config.mask_token_id)
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.gen = generator
        self.lora = getattr(model, "draft_lora", None) if cfg.draft_lora else None
        self.stats = Stats()
        presto = cfg.mode == "presto"
        self.rho = NgramRho(model.config.vocab_size, self.prompt) if presto and cfg.rho in ("ngram", "learned") else None
        self.learned = presto and cfg.rho == "learned"
        if self.learned:
            from .predictor import LearnedRho

            self.extra = make_extra_score(LearnedRho(model.presto_predictor, self.rho), cfg.lam)
        else:
            self.extra = make_extra_score(self.rho, cfg.lam) if presto else None
        self.recorder = None  # optional callback(tree, cand_lq, cand_tok, targets, entropy, history, ngram, node_logits)
        self.k = cfg.tree_top_k if cfg.mode == "presto" else 1
        self.oracle_k = cfg.tree_top_k
        self._pending_oracle: list[tuple[int, torch.Tensor]] = []
        self.emitted: list[int] = []

    # -- model calls -------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                 draft_rows: slice | None = None) -> torch.Tensor:
        """One model call; `draft_rows` are the query rows that get the draft LoRA (if loaded)."""
        t0 = time.perf_counter()
        lora = self.lora if draft_rows is not None else None
        with torch.inference_mode(), (lora.on(draft_rows) if lora is not None else nullcontext()):
            out = self.model(
                tokens.to(self.device)[None],
                position_ids=positions.to(self.device),
                attention_mask=None if mask is None else mask.to(self.device, self.dtype),
                cache=cache,
                use_cache=True,
            ).logits[0]
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.stats.forward_seconds += time.perf_counter() - t0
        return out

    def _targets(self, logits: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return select(logits, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, banned=self.mask_id,
                      generator=self.gen).cpu()

    def _candidates(self, logits: torch.Tensor):
        """(top-k log q, their tokens, marginal entropy or None) per draft depth, on the CPU."""
        lq = draft_logprobs(logits, self.mask_id)
        vals, toks = lq.topk(self.oracle_k, dim=-1)  # the tree uses the first self.k <= oracle_k
        ent = None
        if self.learned or self.recorder is not None:
            ent = -(lq.exp() * lq.nan_to_num(neginf=0.0)).sum(-1).cpu()
        return vals.cpu(), toks.cpu(), ent

    def _draft_pass(self, root: int, c: int):
        """Two-pass draft: [root, M x (B-1)] bidirectional over the cache, which it leaves as is."""
        B = self.cfg.block_length
        block = torch.cat([torch.tensor([root]), torch.full((B - 1,), self.mask_id)])
        mask, pos = draft_block(c, B)
        with kv.read_only(self.cache):
            logits = self._forward(block, pos, mask, self.cache, draft_rows=slice(None))
        self.stats.forwards += 1
        self.stats.query_tokens += B
        return self._candidates(logits[1:])

    # -- drafting ----------------------------------------------------------------------------
    def _draft(self, root: int, cands, room: int) -> Tree:
        if self.cfg.mode == "ar" or cands is None or room <= 1:
            return root_only(root)
        vals, toks, ent = cands
        depth = min(toks.shape[0], room - 1)
        if self.cfg.mode == "linear":
            return chain([root] + toks[:depth, 0].tolist(), torch.cat([torch.zeros(1), vals[:depth, 0].cumsum(0)]))
        return build_tree(root, vals[:, : self.k], toks[:, : self.k], budget=self.cfg.budget,
                          extra_score=self.extra, history=self._history(), max_depth=depth, entropy=ent)

    # -- the loop ----------------------------------------------------------------------------
    def __iter__(self):
        t_start = time.perf_counter()
        try:
            yield from self._run()
        finally:
            self.stats.seconds = time.perf_counter() - t_start
            self._finish_oracle()

    def _emit(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Truncate at eos (inclusive) and at max_new_tokens; returns (chunk, finished)."""
        room = self.cfg.max_new_tokens - len(self.emitted)
        out, done = [], False
        for t in tokens[:room]:
            out.append(t)
            if t in self.eos:
                done = True
                break
        done = done or len(self.emitted) + len(out) >= self.cfg.max_new_tokens
        self.emitted.extend(out)
        self.stats.new_tokens = len(self.emitted)
        if self.rho is not None and out:
            self.rho.extend(out)
        return out, done

    def _prefill(self, cache, one_pass: bool, G: int):
        """The prompt causally (one-pass: plus one mask group after it) -> (first token, marginals)."""
        prompt = torch.tensor(self.prompt)
        L = len(self.prompt)
        if not one_pass:
            logits = self._forward(prompt, torch.arange(L)[None], None, cache)
            return int(self._targets(logits[-1:])[0]), None
        lay = tree_and_groups(0, torch.arange(L) - 1, torch.arange(L), torch.tensor([L - 1]), G)
        logits = self._forward(torch.cat([prompt, torch.full((G,), self.mask_id)]), lay.positions, lay.mask, cache,
                               draft_rows=slice(L, None))
        kv.crop(cache, L)  # keep only the prompt's K/V
        return int(self._targets(logits[L - 1 : L])[0]), self._candidates(logits[L + 1 :])

    def _history(self) -> tuple[int, int]:
        """The last two committed tokens (the second is the root); -1 where the context is shorter."""
        tail = self.emitted[-2:] if len(self.emitted) >= 2 else (self.prompt + self.emitted)[-2:]
        return (tail[0], tail[1]) if len(tail) == 2 else (-1, tail[0])

    def _run(self):
        cfg, model = self.cfg, self.model
        cache = self.cache = kv.new_cache(model)
        one_pass = cfg.mode != "ar" and cfg.schedule == "one-pass"
        G = cfg.group if one_pass else 0
        root, cands = self._prefill(cache, one_pass, G)
        self.stats.prefill_forwards = 1
        chunk, done = self._emit([root])
        yield chunk
        while not done:
            c = kv.length(cache)
            room = cfg.max_new_tokens - len(self.emitted)  # a path of depth d emits d + 1 tokens
            if not one_pass and cfg.mode != "ar":
                cands = self._draft_pass(root, c) if room > 1 else None
            t0 = time.perf_counter()
            tree = self._draft(root, cands, room)
            self.stats.tree_seconds += time.perf_counter() - t0
            if cfg.mode != "ar":
                cand_tokens = cands[1][:, : self.oracle_k] if cands is not None else torch.zeros(0, 1, dtype=torch.long)
                self._pending_oracle.append((len(self.emitted), cand_tokens))
            n = len(tree)
            owners = group_owners(tree, cfg.group_nodes) if one_pass and room > 1 else None
            lay = tree_and_groups(c, tree.parents, tree.depths, owners, G)
            q_tokens = torch.cat([tree.tokens, torch.full((lay.mask.shape[-2] - n,), self.mask_id)])
            mask = None if n == 1 and not one_pass else lay.mask
            logits = self._forward(q_tokens, lay.positions, mask, cache,
                                   draft_rows=slice(n, None) if owners is not None else None)
            self.stats.forwards += 1
            self.stats.query_tokens += q_tokens.shape[0]
            targets = self._targets(logits[:n])
            path, bonus = walk(tree, targets)
            if self.recorder is not None and cands is not None and len(tree) > 1:
                self.recorder(tree, cands[0][:, : self.k], cands[1][:, : self.k], targets, cands[2],
                              self._history(), self.rho, logits[:n])
            if owners is not None:
                # the endpoint's group (or its nearest ancestor's, shifted by the depth gap):
                # slot 0 sits where the bonus goes, later slots are the next round's depths
                j, u = nearest_owner(tree.parents, owners, path[-1])
                skip = 1 + int(tree.depths[path[-1]] - tree.depths[u])
                rows = logits[lay.group_rows(j)][skip:]
                cands = self._candidates(rows) if rows.shape[0] else None
            kv.commit(cache, c, path)
            root = bonus
            self.stats.rounds += 1
            chunk, done = self._emit(tree.tokens[path[1:]].tolist() + [bonus])
            self.stats.accept_lengths.append(len(chunk))
            self.stats.round_tokens += len(chunk)
            yield chunk

    def _finish_oracle(self) -> None:
        for start, cand in self._pending_oracle[: self.stats.rounds]:
            self.stats.oracle_lengths.append(oracle_length(cand, self.emitted[start:]))
        self._pending_oracle.clear()


def generate_ids(model, prompt_ids, cfg: DecodeConfig, **kw) -> tuple[list[int], Stats]:
    """All generated ids (prompt excluded) and the stats of the run."""
    dec = Decoder(model, prompt_ids, cfg, **kw)
    out = [t for chunk in dec for t in chunk]
    return out, dec.stats

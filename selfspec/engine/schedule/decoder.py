"""The decoder: rounds over a batch of sequences with ragged acceptance. One prompt is one row.

`Decoder` is nano-vllm's engine in miniature: a `scheduler.Scheduler` owns the waiting and live
sequences (`sequence.Sequence`, one per prompt), a `step.Stepper` runs one round over the live
rows (plan -> draft -> lay out + forward -> verify + commit -> observe), and `step()` is one turn:
finished rows leave, waiting prompts are prefilled into the free cache rows, then one round runs.
With nothing running the entering prompts are prefilled together in one forward; while rows run,
a prompt is prefilled in chunks, at most one chunk (`prefill_chunk` tokens) per turn, so a long
prompt joining a running batch never stalls its rows for more than a chunk. In the exact formats
the chunk runs inside the live rows' round forward (`BatchForward.joins`: one pass over the
weights for both); elsewhere in a forward of its own before the round. Iterating a decoder runs
turns until every prompt is done and yields `(row, chunk)` as rows commit; `add()` queues another
prompt at any time (a server adds requests while the batch runs, and they join at the next turn).

Rows keep their own cache length, generator, sampling parameters, lookup index and rho, so a
greedy row equals its run alone and a sampled row is an exact sample, reproducible per seed.

Building a decoder reads its inputs once, in order: the request checked (before any model
work), the sequences made (and a replay's AR reference decoded), then the stepper and the
scheduler (which owns the prefill). It measures nothing: plan "auto" gets its planner, and this
device's cost model (measured on first use), when the decoder starts (`start`, `planner`).
"""

from __future__ import annotations

import threading

import torch

from selfspec.engine.forward.batch_forward import BatchForward
from selfspec.engine.measure.cost import cost_model, given_profile
from selfspec.engine.round.rounds import config_label, fixed_option, recorder_observer, stats_observer
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.planning.planner_store import keep_planner, planner_for
from selfspec.engine.request.request import cache_bytes, check_batch, check_request, eos_ids, row_capacity
from selfspec.engine.round.replaying import replaying
from selfspec.engine.schedule.scheduler import Scheduler
from selfspec.engine.request.sequence import ByIndex, SamplingParams, Sequence, prepare, seeded
from selfspec.engine.request.stats import Stats
from selfspec.engine.round.step import Stepper


_PAST_LOCK = threading.Lock()  # a past decoder's cache goes to one new decoder, whatever the threads


class Decoder:
    """Iterates `(row, committed_chunk)` for a batch of prompts. Each prompt is one `Sequence`,
    which owns its state; `sequences[i]`, `outputs[i]`, `stats[i]`, `params[i]` and `prompts[i]`
    read sequence i's (input order, then `add`'s), read-only and keyed by sequence index
    (`sequence.ByIndex`; `forget` drops a finished sequence from all of them).

    `prompts`: token-id lists (a single list of ints is one prompt). `batch_size`: cache rows (how
    many prompts run at once; default all). `seeds` or `generators`: one per prompt. `profile`:
    plan "auto"'s cost model (`cost.CostModel` or a file, read here; default: this device's,
    measured once, when a decoder first starts: `planner`).
    `params`: one `SamplingParams` per prompt (default: the config's). `prefill_chunk`: how many
    prompt tokens a turn prefills while other rows run (None: plan "auto" picks it from its cost
    model, `prefill.Prefill.chunk_tokens`; a fixed mode takes PREFILL_CHUNK); a prompt that enters with nothing
    running is prefilled whole in one forward whatever it is. `past`: a finished decoder of this
    model whose cache this one continues in (`_take_past`: the next turn of a conversation).
    `replay`: a replay profile (`drafting.replay.load_profile`: name, JSON path or profile): the
    draft marginals are replaced by the profile's, drawn against each prompt's greedy AR output
    (`engine.replaying`: decoded first, untimed; greedy only).

    Hooks (None, or set before iterating):

    `recorder(tree, top_lq, top_tok, targets, entropy, history, ngram, node_logits)` after each
    round that verified a drafted tree from marginals (predictor collection): the marginals' top-K
    [D, K], the targets [n], the entropy [D] or None, the two tokens before the root, the n-gram
    rho and the target logits [n, V].

    `on_round(info: dict)`, the round hook: the contract any engine must keep (`selfspec.trace`
    builds on it). Called once per row and verification round, after the walk and after the
    round's tokens were emitted (eos / max_new_tokens truncation applied), with one plain dict
    holding exactly these keys:

        round              int, 0-based index of the row's verification round
        row                int, the prompt's index in the input (0 for a single prompt)
        c                  int, KV-cache length (accepted prefix) before the round
        tree               drafting.tree.Tree that was verified (node 0 = root, `scores` = path
                           scores from construction, or None)
        cands              (top_lq [D, K], top_tok [D, K], entropy [D] or None): the candidates
                           the tree was built from, or None (AR, lookup chains, no room left)
        targets            LongTensor [n]: the target's token after each node's path
        path               list[int]: accepted node indices, root first
        bonus              int: the target token at the end of the path
        committed          list[int]: tokens emitted by this round (accepted draft nodes + bonus,
                           after eos / max_new_tokens truncation)
        layout             str: "ar", "linear/two-pass", "presto/one-pass/N=32", ... (`rounds.config_label`;
                           plan "auto": the round's `Option.label`, e.g. "one-pass/N=8/m=9/G=8")
        forward_seconds    float: this round's model time (two-pass: both passes)
        query_tokens       int: query tokens this round's forwards ran (nodes + mask slots)
        lam                float: lambda of the score (0.0 outside PRESTO and auto)
        oracle_candidates  LongTensor [D, K]: the top-K candidate tokens per depth for oracle tau
    """

    def __init__(self, model, prompts, cfg: DecodeConfig, *, batch_size: int | None = None, eos_token_id=None,
                 generators: list[torch.Generator | None] | None = None, seeds: list[int] | None = None,
                 params: list[SamplingParams] | None = None, max_cache_bytes: int | None = None, profile=None,
                 prefill_chunk: int | None = None, past: "Decoder | None" = None, replay=None):
        # 1. the request, checked before any model work (the profile= file read, never measured)
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if generators is not None and seeds is not None:
            raise ValueError("give per-row generators or per-row seeds, not both")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1, got {prefill_chunk!r}")
        params = list(params) if params is not None else [SamplingParams.of(cfg)] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameters for {len(prompts)} prompts")
        self.model, self.cfg = model, cfg
        self.eos = eos_ids(model, eos_token_id)
        # the model's forward, as the checks found it (finding it walks every parameter: once)
        self.bf = check_batch(model, prompts, cfg, batch_size, generators if seeds is None else seeds,
                              max_cache_bytes) or BatchForward.of(model)
        self._profile = given_profile(model, profile, ff=self.bf.ff) if cfg.plan == "auto" else None
        self.batch_size = batch_size or len(prompts)  # rows at most (a server adds prompts later)

        # 2. the sequences, one per prompt, by index: the only owner of a row's state (`forget`
        # drops a finished one; `outputs`, `stats`, ... read them)
        self._device = model.get_input_embeddings().weight.device  # where the rows' generators draw
        gens = (generators or [None] * len(prompts)) if seeds is None else [seeded(s, self._device) for s in seeds]
        self._seqs = {i: Sequence(i, [int(t) for t in p], gen, sp)
                      for i, (p, gen, sp) in enumerate(zip(prompts, gens, params))}
        self._next = len(prompts)  # the index `add` gives the next sequence
        self._observers: dict[int, list] = {}  # the rows that entered, until forgotten
        self.uses_lookup = cfg.mode == "lookup" or (cfg.mode in ("presto", "auto") and cfg.lookup)
        # acceptance replay: every prompt's AR reference decoded now, by a decoder of this class
        replayed = None if replay is None else replaying(
            model, self.prompts, cfg, self.params, replay, decoder=type(self), eos_token_id=eos_token_id,
            max_cache_bytes=max_cache_bytes, batch_size=batch_size)
        for s in self._seqs.values():
            s.stats.replay = None if replayed is None else replayed.name

        # 3. the stepper (rounds; plan "auto" gets its planner when it starts: `planner`) and the
        # scheduler
        lora = getattr(model, "draft_lora", None) if cfg.draft_lora and cfg.mode not in ("ar", "lookup") else None
        self.bf.ff.prepare_lora(lora)
        fixed = None if cfg.plan == "auto" else fixed_option(cfg)
        self.stepper = Stepper(self.bf, cfg, mask_id=int(model.config.mask_token_id), eos=self.eos, lora=lora,
                               fixed=fixed, fixed_label=config_label(cfg))
        self.stepper.replay = replayed
        # the scheduler owns the prefill (`scheduler.prefill`), which runs its forwards on the stepper
        self.scheduler = Scheduler(self.batch_size, stepper=self.stepper, prefill_chunk=prefill_chunk,
                                   prefill_group=fixed is None or fixed.groups > 0)
        self.on_round = None
        self._capacity = row_capacity(prompts, cfg) if prompts else 1
        self._past = None if past is None else self._take_past(past)  # now: two turns never take one cache
        self.closed = False  # `close` ran: the iteration ended (finished or stopped)

    # -- the sequences, read through them: snapshots keyed by sequence index (`sequence.ByIndex`) --------
    sequences = property(lambda self: ByIndex(self._seqs), doc="Every sequence not forgotten, by index.")
    prompts = property(lambda self: self._column("prompt"))
    params = property(lambda self: self._column("params"))
    outputs = property(lambda self: self._column("emitted"), doc="Each sequence's tokens so far (its own list).")
    stats = property(lambda self: self._column("stats"))

    def _column(self, field: str) -> ByIndex:
        return ByIndex({i: getattr(s, field) for i, s in self._seqs.items()})

    @property
    def planner(self):
        """plan "auto": this decoder's planner (None for a fixed mode); made when the decoder starts,
        or when asked for before (`_plan`)."""
        return self._plan()

    def _plan(self):
        """plan "auto": the planner, made once, forked from the model's stored one (`planner_store`)
        over the cost model, which `cost.cost_model` measures now when profile= gave none and this
        device has none cached: the one place a decoder may measure (building one never does)."""
        if self.stepper.planner is None and self.cfg.plan == "auto":
            rows = min(self.batch_size, len(self._seqs)) if self._seqs else self.batch_size
            cost = cost_model(self.model, self._profile, rows=rows, ff=self.bf.ff)
            replayed = self.stepper.replay
            self.stepper.planner = planner_for(self.model, self.cfg, cost,
                                               replay=None if replayed is None else replayed.name)
        return self.stepper.planner

    @property
    def recorder(self):
        return self.stepper.recorder

    @recorder.setter
    def recorder(self, fn) -> None:
        self.stepper.recorder = fn

    @property
    def cache(self):
        return self.stepper.cache

    # -- the loop ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Plan, allocate the cache and queue the prompts (iterating does it; a server calls it
        once): plan "auto" gets its planner now (`planner`: its cost model measured here on first
        use)."""
        if self.stepper.cache is None:
            self._plan()  # plan "auto": the cost model measured now if need be
            rows = max(1, min(self.batch_size, len(self._seqs)))
            past, self._past = self._past, None
            cache = self.bf.new_cache(rows, self._capacity) if past is None else past[0]
            cache.reserve(self._capacity, rows)
            self.stepper.cache = cache
            if past is not None:
                self.scheduler.prefill.keep_past(past[1])
            for s in self._seqs.values():
                self._queue(s)

    def _take_past(self, past: "Decoder"):
        """(`past`'s cache, taken over (the past decoder has none after this: a conversation goes on
        in one place), the tokens of its first row), which `start` gives the prefill (`keep_past`:
        the prompt entering that row keeps the K/V it starts with); None where the K/V were made
        otherwise (other weights or cache format) or by no sequence. A past taken already is a
        ValueError."""
        with _PAST_LOCK:
            cache = past.stepper.cache
            if cache is None:
                raise ValueError("past= was continued already: pass the latest generation of the conversation")
            seq = past._seqs.get(0)
            if past.bf.ff is not self.bf.ff or cache.dtype != self.bf.cache_dtype or seq is None:
                return None
            past.stepper.cache = None
        return cache, seq.prompt + seq.emitted

    def add(self, prompt_ids: list[int], *, params: SamplingParams | None = None,
            generator: torch.Generator | None = None, seed: int | None = None) -> Sequence:
        """Queue one more prompt (checked like the others); it joins at the next turn with a free
        row. Returns its sequence (`.emitted`, `.stats`, `.done`); its row index is `.index`.
        `seed`: its sampling seed (the same seed gives the same tokens); or a `generator`."""
        params = params or SamplingParams.of(self.cfg)
        check_request(self.model, prompt_ids, self.cfg, params)
        self.start()
        gen = generator if seed is None else seeded(seed, self._device)
        seq = self._seqs[self._next] = Sequence(self._next, [int(t) for t in prompt_ids], gen, params)
        self._next += 1
        # rows grow straight to batch_size: growing a float64 cache step by step (1, 2, 4, ...) costs
        # a reallocation and a copy of every row each time, seconds of a burst's time to first token
        sched = self.scheduler
        waiting = len(sched.live) + len(sched.prefilling) + len(sched.waiting) + 1
        rows = self.batch_size if waiting > self.stepper.cache.rows else 0
        self.stepper.cache.reserve(row_capacity([prompt_ids], self.cfg, params), rows)
        return self._queue(seq)

    def reserve(self, *, prompt_tokens: int, max_new_tokens: int) -> int:
        """Allocate the cache now for `batch_size` rows of a prompt of `prompt_tokens` and
        `max_new_tokens` new tokens (a server does it before it takes requests, so that none of
        them waits for an allocation; a longer request still grows it). Returns its bytes."""
        if prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError(f"reserve needs prompt_tokens and max_new_tokens >= 1, got {prompt_tokens}, {max_new_tokens}")
        cap = row_capacity([[0] * prompt_tokens], self.cfg, SamplingParams(max_new_tokens=max_new_tokens))
        need = cache_bytes(self.bf, self.batch_size, cap)
        self.start()
        self.stepper.cache.reserve(cap, self.batch_size)
        return need

    def _queue(self, s: Sequence) -> Sequence:
        self.scheduler.add(prepare(s, self.model, self.cfg, lookup=self.uses_lookup))
        return s

    def cancel(self, seq: Sequence) -> bool:
        """Stop a sequence at the next turn (its row is freed); False if it had ended already."""
        return self.scheduler.cancel(seq)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence from the decoder: it leaves with everything it held (prompt,
        tokens, stats, parameters, generator) and so do its observers (a long-running server reads
        what it needs from the sequence and then lets it go; nothing of it stays behind)."""
        if not seq.done:
            raise ValueError("forget() takes a finished or cancelled sequence")
        del self._seqs[seq.index]
        self._observers.pop(seq.index, None)

    def step(self) -> list[tuple[int, list[int]]]:
        """One turn (`turn`), run to its end. Returns the `(row, chunk)` commits, in order."""
        return list(self.turn())

    def turn(self):
        """One turn, as nano-vllm's step: schedule, run, postprocess. The scheduler's prefill
        (`prefill.Prefill.enter`) lets finished rows leave and waiting prompts take free rows,
        prefilling them whole with nothing running (their first tokens are yielded right away: time
        to first token is one prefill) or a chunk while rows run; the stepper runs one round over
        the live rows, carrying the next chunk in its forward where the format allows
        (`Prefill.ride`); then the prompts that chunk completed go live and finished rows leave
        (`Prefill.after_round`). Yields `(row, chunk)` as rows commit."""
        self.start()
        sched = self.scheduler
        yield from self._welcome(*sched.prefill.enter())
        if sched.live:
            rnd = self.stepper.step(sched.live, draining=sched.draining, observers=self._observers,
                                    join=sched.prefill.ride())
            entering, chunks = sched.prefill.after_round(rnd)
            for r in rnd.rows:
                yield r.seq.index, r.committed
            yield from self._welcome(entering, chunks)

    def _welcome(self, entering: list, chunks: list):
        """Sequences that just got their first tokens: their observers, then their first chunks."""
        for s, chunk in zip(entering, chunks):
            self._observers[s.index] = self._observers_of(s)
            yield s.index, chunk

    @property
    def busy(self) -> bool:
        """Prompts wait or run."""
        return self.stepper.cache is None or self.scheduler.busy

    def __iter__(self):
        self.start()
        try:
            while self.scheduler.busy:
                yield from self.turn()
        finally:
            self.close()

    def close(self) -> None:
        """What the unfinished sequences measured so far; the planner's learning kept for the next
        generation with these settings."""
        self.closed = True
        for s in self._seqs.values():
            s.finish()
        if self.stepper.planner is not None:
            keep_planner(self.stepper.planner)

    def _observers_of(self, s: Sequence) -> list:
        """Who reads a row's finished round, in order: stats, the recorder, the round hook."""
        obs = [stats_observer(s.stats)]
        if self.stepper.recorder is not None:
            obs.append(recorder_observer(self.stepper.recorder, self.cfg.tree_top_k, s.rho))
        if self.on_round is not None:
            lam = self.cfg.lam if self.cfg.mode in ("presto", "auto") else 0.0
            hook, top_k = self.on_round, self.cfg.tree_top_k
            obs.append(lambda r, rnd: hook(r.info(rnd.layout, lam, top_k)))
        return obs


def generate_ids(model, prompt_ids, cfg: DecodeConfig, *, generator=None, **kw) -> tuple[list[int], Stats]:
    """One prompt's generated ids (prompt excluded) and stats."""
    dec = Decoder(model, [prompt_ids], cfg, generators=None if generator is None else [generator], **kw)
    for _ in dec:
        pass
    return dec.outputs[0], dec.stats[0]


def generate_batch_ids(model, prompts_ids, cfg: DecodeConfig, **kw) -> tuple[list[list[int]], list[Stats]]:
    """Every prompt's generated ids (prompt excluded) and stats, in input order."""
    dec = Decoder(model, prompts_ids, cfg, **kw)
    for _ in dec:
        pass
    return list(dec.outputs), list(dec.stats)


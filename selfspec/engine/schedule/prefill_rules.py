"""The prefill's pure rules (`prefill.Prefill` applies them; `round_costs` prices the chunks).

A prompt that joins running rows goes in chunks. Plan "auto" sizes a chunk from what rounds and
chunks are measured to take (`round_costs.pick_chunk`); a fixed mode takes PREFILL_CHUNK tokens.

A chunk that cannot ride in the round's forward (its own forward: fp32, and w4a8, whose rounds run
all their layers in one C call) pays a whole pass over the weights however few its tokens, so it
is made big enough to be worth one (PREFILL_OWN_ROUNDS AR rounds) and spaced (`chunk_due`): the
rows run twice its time before the next one (a few tokens' chunk every turn had stretched each
running row's gap several-fold and delayed a long prompt's first token for seconds).

Spacing is for a long prompt's pieces: a chunk that prefills short prompts whole (each from its
first token) runs at once, as many of them as fit in one such forward (`whole_prompts`), since a
free row that waits for its prompt decodes nothing and the chunk's time is paid whenever it runs.
Spacing them too left rows empty several times as long as a fixed mode's immediate joins and
cost `auto` its floor.

A burst is another matter: while more prompts wait for their first token than rows run, every
waiting prompt is prefilled in the turn (`prefill_first`): each of them gains a whole row's
tokens from joining, each running row loses one gap. Prompts that enter together take rows
shortest first, and are prefilled in forwards over groups of rows of similar length
(`prefill_groups`): a forward pads every row to its longest.

Prompts that start alike share their prefix's K/V (`shared_prefixes`, `kept_prefixes`).
"""

from __future__ import annotations

PREFILL_CHUNK = 256  # prompt tokens a turn prefills while rows run, when no cost model picks it
PREFILL_OWN_ROUNDS = 12.0  # a chunk in a forward of its own (it cannot ride: fp32, w4a8's one-call rounds)
# pays a whole pass over the weights however few its tokens (a 1-token chunk already costs about an AR round
# of 4 rows): it may cost this many AR rounds (`round_costs.PREFILL_ROUNDS` where it rides), and such chunks
# come spaced (PREFILL_SHARE)
PREFILL_SHARE = 1 / 3  # own-forward chunks take at most this share of the time while rows run: the next one waits
# until the rows have run (1 - share) / share times the last one's time. At 12 rounds a chunk, about 1 turn in 25
# has one: the running rows' p95 gap stays their own, their slowest ~13 rounds
SHARED_MIN = 16  # prompts starting with this many tokens alike or more prefill their common prefix once
# A prompt longer than this is prefilled in forwards of this many tokens: the exact attention's
# float64 scores of one forward grow with the square of its width (the K/V are bitwise the same).
PREFILL_PIECE = 128


def prefill_first(prefilling: int, live: int) -> bool:
    """Whether a turn prefills all `prefilling` prompts at once (a burst: they outnumber the `live`
    rows) rather than a chunk: a prompt without its first token gains a whole row's decoding from
    joining, a running row loses one gap. A long prompt joining a running batch (1 <= live) keeps
    to chunks, so that its rows' inter-token latency holds."""
    return prefilling > live


def prefill_groups(lefts: list[int], price) -> list[tuple[int, int]]:
    """Consecutive groups [a, b) of rows whose prefill forwards cost least in all: rows with
    `lefts[i]` prompt tokens to go (shortest first, as they take rows), a forward over rows a..b-1
    costing price(b - a, max(lefts[a:b])) (every row padded to its longest). Dynamic programming
    over the split points; `price(rows, width)` is a cost model's f(rows, width), or tokens plus a
    forward's fixed cost (`round_costs.token_price`).

    Example: lefts [10, 12, 40, 44] at 8 tokens a forward plus 1 a token: one forward pads to
    4 x 44 + 8 = 184, two forwards [10, 12] and [40, 44] cost 2 x 12 + 8 + 2 x 44 + 8 = 128."""
    n = len(lefts)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(b):
            c = best[a] + price(b - a, max(lefts[a:b]))
            if c < best[b]:
                best[b], cut[b] = c, a
    groups, b = [], n
    while b:
        groups.append((cut[b], b))
        b = cut[b]
    return groups[::-1]


def whole_prompts(lefts: list[int], price, budget: float) -> int:
    """How many of the waiting prompts (`lefts`: their tokens left, in the order they take rows)
    one forward prefills whole within `budget`: the largest k with price(k x max(lefts[:k])) <=
    budget (a forward pads every row to its longest), 0 when not even the first fits.

    Example: lefts [30, 40, 200] at 1 time unit a token and a budget of 100: 2 (2 x 40 = 80 tokens;
    3 x 200 = 600 do not fit)."""
    k, widest = 0, 0
    for n in lefts:
        widest = max(widest, n)
        if price((k + 1) * widest) > budget:
            break
        k += 1
    return k


def chunk_due(rows_seconds: float, chunk_seconds: float, share: float = PREFILL_SHARE) -> bool:
    """Whether an own-forward chunk may run: the rows have run `rows_seconds` since the last one,
    which took `chunk_seconds`, and chunks take at most `share` of the time.

    Example: a chunk took 80 (any unit); at share 1/3 the next waits for 160 of rounds."""
    return rows_seconds >= chunk_seconds * (1.0 - share) / share


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def kept_prefixes(retained: dict, start: int, prompts: list[list[int]]) -> list[int]:
    """The slots each of rows start.. keeps for the prompt entering it (`BatchKVCache.claim`): what
    the row retained of a finished sequence (`retained`: row -> tokens), where the prompt starts
    with SHARED_MIN or more of those tokens, all but the prompt's last token at most; else 0."""
    keep = []
    for i, p in enumerate(prompts):
        held = retained.get(start + i)
        c = common_prefix(held, p) if held is not None else 0
        keep.append(min(c, len(p) - 1) if c >= SHARED_MIN else 0)
    return keep


def shared_prefixes(prompts: list, donors: list, least: int = SHARED_MIN) -> list[tuple]:
    """Which rows about to be prefilled can copy a prefix's K/V instead of running it: `prompts[i]`
    the prompt of row i (None: a row that holds part of its prompt already), `donors` `(row,
    tokens)` of rows whose cache holds `tokens`. Rows whose prompts start with the same `least`
    tokens form a group; their common prefix (each keeps at least its last token to run) comes
    from a donor holding `least` or more of it (then as much as it holds), else from the group's
    first row, which prefills it once. Returns `(donor, src, n, rows)`: copy the first n slots of
    src into each of `rows` (indices into `prompts`); src is a donor's row (donor True) or an index
    into `prompts` whose row prefills its first n tokens before the copies (donor False).

    Example: prompts [A+x, A+y, B] with A 20 tokens, no donors: [(False, 0, 20, [1])]; with a donor
    (7, A+z): [(True, 7, 20, [0, 1])]."""
    groups: dict = {}
    for i, p in enumerate(prompts):
        if p is not None and len(p) > least:
            groups.setdefault(tuple(p[:least]), []).append(i)
    plan = []
    for rows in groups.values():
        first = prompts[rows[0]]
        n = min(min(len(prompts[i]) for i in rows) - 1, *(common_prefix(first, prompts[i]) for i in rows))
        held, src = max(((common_prefix(first, t), r) for r, t in donors), default=(0, None))
        if held >= least:
            plan.append((True, src, min(n, held), rows))
        elif len(rows) > 1 and n >= least:
            plan.append((False, rows[0], n, rows[1:]))
    return plan

"""A long prompt joining running rows: the running rows' inter-token latency without and while it
is prefilled, chunked (issue 37) and in one forward.

    python benchmarks/long_prompt_join.py                       # 4 rows, a ~2000-token prompt, plan auto
    python benchmarks/long_prompt_join.py --mode ar --chunk 128
    python benchmarks/long_prompt_join.py --tokens 8 --prompt-tokens 200   # a smoke run
    python benchmarks/long_prompt_join.py --shared 1900        # a document asked a second question

Through the in-process `Decoder` (no HTTP), on this main thread, as the server's engine drives it:
`--rows` short prompts (the model's prompts.jsonl) run greedy with eos off; after `--warmup`
turns the long prompt (the same file's texts repeated up to `--prompt-tokens` tokens) is added
(`Decoder.add`), and turns go on until its first token and `--tokens` turns more. A row's
inter-token latency is the time between two of its successive commits (what a streaming client
waits). Three runs, each on a fresh decoder: `chunked` (`prefill_chunk=--chunk`, default
automatic), `baseline` (nobody joins; as many turns as `chunked` took to the long prompt's first
token, or `--tokens`) and `one_forward` (a chunk as long as the prompt: the stall chunking
avoids). Each reports p50 / p95 / max of the running rows' gaps (ms) over the measured turns; the
joins also over the gaps that end between the add and the long prompt's first token
(`during_prefill`), that time to first token, its turns and prefill forwards; the baseline also
over the same turns (`same_turns`: the rows' contexts grow a token or more a turn, so gaps at
turn 1,000 are not gaps at turn 50), and `p95_during_vs_same_turns` is issue 37's ratio. `--shared N`: the first
running row's prompt is the long prompt's first N tokens and a question of its own (one document
asked twice), so the joining prompt copies those N tokens' K/V from that row and prefills only
the rest. Prints one JSON record with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def texts(path: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            out.append(rec.get("prompt") or "\n".join(m["content"] for m in rec.get("messages", [])))
    return [t for t in out if t]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 3)


def summary(gaps: list[float]) -> dict:
    return {"n": len(gaps), "p50_ms": pct(gaps, 0.5), "p95_ms": pct(gaps, 0.95), "max_ms": pct(gaps, 1.0)}


def run(model, cfg, shorts, long, *, chunk, warmup: int, tokens: int, join: bool, window: int = 0) -> dict:
    """One decoder's gaps; `window` > 0 (the baseline): also the gaps of its first `window` turns after
    the warm-up (`same_turns`), the turns a joining prompt's prefill took in the chunked run: the rows'
    own contexts grow by a token or more a turn, so only those turns compare with `during_prefill`."""
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.sequence import SamplingParams

    dec = Decoder(model, shorts, cfg, batch_size=len(shorts) + 1, eos_token_id=[], prefill_chunk=chunk)
    rows = set(range(len(shorts)))
    last: dict[int, float] = {}
    gaps, during, same = [], [], []
    for _ in range(warmup):
        for row, _piece in dec.turn():
            last[row] = time.perf_counter()
    seq, added, first, left, turn, turns_first = None, None, None, max(tokens, window), 0, None
    if join:
        seq = dec.add(long, params=SamplingParams(max_new_tokens=8))
        added = time.perf_counter()
    while left > 0 and dec.busy:
        turn += 1
        for row, piece in dec.turn():
            now = time.perf_counter()
            if row in rows and piece:
                if row in last:
                    gaps.append(now - last[row])
                    if join and first is None:
                        during.append(now - last[row])
                    if turn <= window:
                        same.append(now - last[row])
                last[row] = now
            elif seq is not None and row == seq.index and first is None:
                first, turns_first = now, turn
        if not join or first is not None:
            left -= 1
    out = {"gaps": summary(gaps)}
    if window:
        out["same_turns"] = dict(summary(same), turns=window)
    if join:
        out.update(during_prefill=summary(during), ttft_ms=None if first is None else round(1e3 * (first - added), 3),
                   turns=turns_first, prefill_forwards=seq.stats.prefill_forwards,
                   chunk=chunk if chunk is not None else "auto")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or model name (default: selfspec.load()'s)")
    ap.add_argument("--weights", default=None, help="weight format (default: the loader's)")
    ap.add_argument("--mode", default=None, help="a fixed layout, e.g. ar (default: plan auto)")
    ap.add_argument("--rows", type=int, default=4, help="running rows")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="the joining prompt's tokens")
    ap.add_argument("--chunk", type=int, default=None, help="prefill_chunk of the chunked run (default: automatic)")
    ap.add_argument("--warmup", type=int, default=8, help="turns before the long prompt joins")
    ap.add_argument("--tokens", type=int, default=64, help="turns measured (after the long prompt's first token)")
    ap.add_argument("--prompts", default=None, help="JSONL prompt file (default: the model's prompts.jsonl)")
    ap.add_argument("--shared", type=int, default=0, help="the first running row's prompt starts with the long "
                    "prompt's first N tokens (default 0: nothing shared)")
    a = ap.parse_args(argv)
    if not 0 <= a.shared < a.prompt_tokens:
        ap.error(f"--shared must be in 0 .. --prompt-tokens - 1 ({a.prompt_tokens - 1}), got {a.shared}")

    import selfspec
    from selfspec.engine.options import DecodeConfig

    kw = {"weights": a.weights} if a.weights else {}
    model, tok = selfspec.load(a.model, **kw) if a.model else selfspec.load(**kw)
    path = a.prompts or next((p for p in (os.path.join(getattr(model, "name_or_path", "") or "", "prompts.jsonl"),
                                          os.path.join(HERE, "models", "smollm2-135m-instruct", "prompts.jsonl"))
                              if os.path.isfile(p)))
    pool = texts(path)
    shorts = [tok.encode(pool[i % len(pool)]) for i in range(a.rows)]
    ids: list[int] = []
    i = a.rows
    while len(ids) < a.prompt_tokens:
        ids += tok.encode(pool[i % len(pool)] + "\n\n")
        i += 1
    long = ids[: a.prompt_tokens]
    if a.shared:
        shorts[0] = long[: a.shared] + tok.encode("\n\nWhat is the first sentence about?")
    room = model.config.max_position_embeddings - max(map(len, shorts)) - 64
    layout = {"mode": a.mode} if a.mode else {}
    cfg = DecodeConfig(max_new_tokens=min(room, a.warmup + a.prompt_tokens + 2 * a.tokens + 64), **layout)
    kw = dict(warmup=a.warmup, tokens=a.tokens)
    rec = {"command": "python " + " ".join([os.path.relpath(__file__, HERE)] + (argv if argv is not None else sys.argv[1:])),
           "rows": a.rows, "prompt_tokens": len(long), "shared_tokens": a.shared, "plan": cfg.plan, "mode": cfg.mode,
           "chunked": run(model, cfg, shorts, long, chunk=a.chunk, join=True, **kw)}
    rec["baseline"] = run(model, cfg, shorts, long, chunk=a.chunk, join=False, window=rec["chunked"]["turns"] or 0, **kw)
    rec["one_forward"] = run(model, cfg, shorts, long, chunk=len(long), join=True, **kw)
    same, during = rec["baseline"].get("same_turns", {}).get("p95_ms"), rec["chunked"]["during_prefill"]["p95_ms"]
    rec["p95_during_vs_same_turns"] = round(during / same, 3) if same and during else None
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m selfspec profile --lora-cost`: what the draft LoRA adds to a forward on this device.

Per round width w, a forward of w query tokens over `cache` cached tokens (the root and a mask
group that sees the root and itself, as a probe's round) with and without the draft LoRA on the
mask rows, the head on every row; the median of `repeats` after three untimed calls, widths and
the two variants taking turns so a drifting machine moves both alike."""

from __future__ import annotations

import time


def lora_costs(model, widths, *, cache: int = 100, repeats: int = 15) -> list[dict]:
    import torch

    from selfspec.engine.forward.batch_forward import BatchForward

    lora = getattr(model, "draft_lora", None)
    if lora is None:
        raise ValueError("this model has no draft LoRA (linear_spec_lora/ in its checkpoint), so no LoRA cost")
    bf = BatchForward.of(model)
    kv = bf.new_cache(1, cache + max(widths) + 1)
    ids = torch.arange(cache) % 1000 + 5
    bf(ids[None], torch.arange(cache)[None], kv, slice(0, 1), causal=True)
    kv.set_length(0, cache)

    def forward(w: int, with_lora: bool) -> float:
        block = torch.zeros(1, w, w)
        block[0, 0, 1:] = float("-inf")  # the root sees itself; the mask group sees the root and itself
        kw = dict(lora=lora, lora_rows=slice(1, None)) if with_lora and w > 1 else {}
        t0 = time.perf_counter()
        h = bf(torch.arange(w)[None] + 7, torch.arange(w)[None], kv, slice(0, 1), block=block if w > 1 else None, **kw)
        bf.logits(h[0])
        return time.perf_counter() - t0

    times = {(w, v): [] for w in widths for v in (False, True)}
    for key in times:
        for _ in range(3):
            forward(*key)
    for i in range(repeats):  # each repeat visits every point, in alternating order
        for key in (list(times) if i % 2 == 0 else list(times)[::-1]):
            times[key].append(forward(*key))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return [{"width": w, "cached": cache, "ms": 1e3 * med[w, False], "lora_ms": 1e3 * med[w, True],
             "lora_share": med[w, True] / med[w, False] - 1} for w in widths]


def lora_table(rows: list[dict]) -> str:
    lines = ["| width | cached | no LoRA ms | LoRA on the mask rows ms | added |", "|---|---|---|---|---|"]
    lines += [f"| {r['width']} | {r['cached']} | {r['ms']:.2f} | {r['lora_ms']:.2f} | {100 * r['lora_share']:+.1f}% |"
              for r in rows]
    return "\n".join(lines)

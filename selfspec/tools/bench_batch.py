"""`python -m selfspec bench --batch-sizes 1 4 8 16`: batched decoding against its peers.

For every batch size B, every mode (default: ar and auto) decodes the whole prompt set with B
rows at a time (continuous batching: a finished row's cache row takes the next prompt), and
transformers' batched `generate` on the same weights decodes it in chunks of B with left
padding, as its users run it. Tokens/s is every new token of the set over the wall time of the
set (prefills included). At T = 0 every row is checked token for token against selfspec's
batch-1 AR output (rows_equal_ar; an untimed batch-1 decode when the grid has no B = 1). Same
table, results.json and summary line as the bench.
"""

from __future__ import annotations

import sys
import time

import torch

from selfspec.engine.request.options import DecodeConfig
from selfspec.tools.bench_report import CONTROL


def hf_batched(lm, prompts: list[list[int]], B: int, *, max_new_tokens: int, temperature: float, eos: set[int],
               pad: int, mask_id: int, seed: int) -> tuple[list[list[int]], float]:
    """transformers `generate` in chunks of B prompts, left-padded; (new ids per prompt, seconds).
    A row's output is cut after its first eos (`generate` pads finished rows)."""
    outs: list[list[int]] = []
    dev = lm.lm_head.weight.device
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    for s in range(0, len(prompts), B):
        chunk = prompts[s : s + B]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk], device=dev)
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=dev)
        kw = dict(do_sample=True, temperature=temperature, top_p=None, top_k=None) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = lm.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                              eos_token_id=sorted(eos) or None, pad_token_id=pad, suppress_tokens=[mask_id], **kw)
        for row in out[:, L:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            outs.append(row[:cut])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return outs, time.perf_counter() - t0


def run_batch_bench(model, prompts_ids: list[list[int]], ids: list[str], batch_sizes: list[int], modes: list[str],
                    *, max_new_tokens: int, temperatures: list[float], peers: tuple[str, ...] = ("hf",), seed: int = 0,
                    progress: bool = True, profile=None, base: dict | None = None, repeats: int = 1,
                    control: bool = False) -> list[dict]:
    """One row per (mode or peer, B, temperature): tokens/s, rows equal to batch-1 AR (T = 0),
    tau and plan_hist summed over the rows (of a mode's first run: each runs 2 x `repeats` times,
    see below). `control`: AR again as a row of its own (`CONTROL`), timed like the others."""
    from tqdm import tqdm

    from selfspec.engine.schedule.decoder import Decoder
    from selfspec.engine.request.request import eos_ids
    from selfspec.tools.peers import causal_lm

    base = dict(base or {})
    eos = eos_ids(model)
    mask_id = int(model.config.mask_token_id)
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    lm = causal_lm(model) if "hf" in peers else None
    runs = list(modes) + ([CONTROL] if control else []) + (["hf"] if "hf" in peers else [])
    n_runs = 2 * repeats * len(temperatures) * len(batch_sizes) * len(runs)
    bar = tqdm(total=n_runs, desc="bench (batches)", file=sys.stderr, disable=not progress)
    rows = []
    warm = DecodeConfig(mode="ar", max_new_tokens=4)
    for _ in Decoder(model, prompts_ids[:2], warm):  # warm-up: tables, allocator
        pass
    for t in temperatures:
        for B in batch_sizes:
            # every mode twice, in order and then in reverse (A B C C B A), `repeats` times: a
            # machine whose speed drifts during the block moves every mode alike instead of
            # favouring the first, and more repeats average its bursts out
            timed: dict[str, list] = {}
            for mode in (runs + runs[::-1]) * repeats:
                outs, dt, extra = _batch_run(model, prompts_ids, mode, B, t, base, max_new_tokens, seed, profile, lm,
                                             eos, pad, mask_id)
                timed.setdefault(mode, [outs, extra, []])[2].append((sum(len(o) for o in outs), dt))
                bar.update(1)
                if mode == "hf":  # untimed, a few AR tokens of ours: the run after transformers' fp32 weights
                    for _ in Decoder(model, prompts_ids[:2], warm):  # starts cold (`run_bench`)
                        pass
            for mode in runs:
                outs, extra, each = timed[mode]
                label = "hf-generate (left padding)" if mode == "hf" else mode
                rows.append(_row(label, mode, B, t, outs, each, **extra))
    bar.close()
    if 0 in temperatures:  # every greedy row against batch-1 AR: its timed rows' outputs, or one untimed
        # decode when batch size 1 is not in the grid (before, such a grid checked nothing)
        ref = next((r["token_ids"] for r in rows if r["mode"] == "ar" and r["batch_size"] == 1
                    and r["temperature"] == 0), None)
        if ref is None:
            ref = _batch_run(model, prompts_ids, "ar", 1, 0.0, base, max_new_tokens, seed, None, lm, eos, pad,
                             mask_id)[0]
        for r in rows:
            if r["temperature"] == 0:
                r["rows_equal_ar"] = sum(o == x for o, x in zip(r["token_ids"], ref))
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["batch_size"] == r["batch_size"]
                   and x["temperature"] == r["temperature"]), None)
        ar1 = next((x for x in rows if x["mode"] == "ar" and x["batch_size"] == 1
                    and x["temperature"] == r["temperature"]), None)
        hf = next((x for x in rows if x["mode"] == "hf" and x["batch_size"] == r["batch_size"]
                   and x["temperature"] == r["temperature"]), None)
        r["speedup_vs_batched_ar"] = r["tokens_per_second"] / ar["tokens_per_second"] if ar else None
        r["speedup_vs_batched_ar_runs"] = run_speedups(r, ar) if ar and r is not ar else None
        r["speedup_vs_ar_b1"] = r["tokens_per_second"] / ar1["tokens_per_second"] if ar1 else None
        r["speedup_vs_hf"] = r["tokens_per_second"] / hf["tokens_per_second"] if hf else None
    return rows


def _batch_run(model, prompts_ids, mode, B, t, base, max_new_tokens, seed, profile, lm, eos, pad, mask_id):
    """One decode of the prompt set B rows at a time: (outputs, seconds, tau and plan_hist)."""
    from collections import Counter

    from selfspec.engine.schedule.decoder import Decoder

    if mode == "hf":
        outs, dt = hf_batched(lm, prompts_ids, B, max_new_tokens=max_new_tokens, temperature=t, eos=eos, pad=pad,
                              mask_id=mask_id, seed=seed)
        return outs, dt, {}
    cfg = DecodeConfig(**{**base, "mode": "ar" if mode == CONTROL else mode, "max_new_tokens": max_new_tokens,
                          "temperature": t})
    dec = Decoder(model, prompts_ids, cfg, batch_size=B, seeds=[seed + i for i in range(len(prompts_ids))],
                  profile=profile if cfg.plan == "auto" else None)
    t0 = time.perf_counter()
    for _ in dec:
        pass
    dt = time.perf_counter() - t0
    hist = sum((Counter(s.plan_hist) for s in dec.stats), Counter())
    acc = [a for s in dec.stats for a in s.accept_lengths]
    return dec.outputs, dt, {"tau": sum(acc) / len(acc) if acc else None, "plan_hist": dict(hist)}


def _row(label, mode, B, t, outs, each: list[tuple[int, float]], **extra) -> dict:
    """`each`: (tokens, seconds) of every run of the mode, in run order (summed for its tok/s, kept
    for `run_speedups`); `outs` (and `extra`) from its first."""
    tokens, seconds = sum(n for n, _ in each), sum(s for _, s in each)
    return {"label": f"{label} B={B}", "mode": mode, "batch_size": B, "temperature": t,
            "new_tokens": sum(len(o) for o in outs), "runs": len(each),
            "seconds": round(seconds, 3), "tokens_per_second": tokens / seconds,
            "run_tokens": [n for n, _ in each], "run_seconds": [round(s, 4) for _, s in each],
            "rows_equal_ar": None,  # T = 0: set against batch-1 AR once every row has run (`run_batch_bench`)
            "rows": len(outs), **extra, "token_ids": outs}


def run_speedups(row: dict, ar: dict) -> list[float] | None:
    """The row's tok/s over batched AR's run by run: run j of each (A B B A: run j of one beside run j
    of the other), so their spread shows what the machine's drift does to one pair; None for a single
    pair or runs without time."""
    pairs = list(zip(row.get("run_tokens", []), row.get("run_seconds", []), ar.get("run_tokens", []),
                     ar.get("run_seconds", [])))
    if len(pairs) < 2 or not all(s > 0 and a_s > 0 and a_n > 0 for _, s, a_n, a_s in pairs):
        return None
    return [(n / s) / (a_n / a_s) for n, s, a_n, a_s in pairs]


def batch_table(rows: list[dict]) -> str:
    head = "| row | T | tokens/s | x batched AR | x AR B=1 | x HF | rows = AR | tau | plan |\n|---|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"  # noqa: E731
        plan = ", ".join(f"{k} {v}" for k, v in sorted((r.get("plan_hist") or {}).items(), key=lambda kv: -kv[1])[:3])
        eq = "" if r["rows_equal_ar"] is None else f"{r['rows_equal_ar']}/{r['rows']}"
        lines.append(f"| {r['label']} | {r['temperature']:g} | {r['tokens_per_second']:.1f} | "
                     f"{f(r['speedup_vs_batched_ar'])} | {f(r['speedup_vs_ar_b1'])} | {f(r['speedup_vs_hf'])} | {eq} | "
                     f"{f(r.get('tau'))} | {plan} |")
    return "\n".join(lines)


def batch_floor_lines(rows: list[dict]) -> list[str]:
    """One line per batch size and temperature: plan auto against batched AR (a batch is timed
    whole, so there is no worst prompt to name; the rows' greedy equality is in the table), and
    under it the control row's (AR again) against the same AR runs."""
    out = []
    for r in rows:
        name = {"auto": "auto / batched AR", CONTROL: "control AR / batched AR"}.get(r["mode"])
        if name and r.get("speedup_vs_batched_ar") is not None:
            each = r.get("speedup_vs_batched_ar_runs")
            out.append(f"{name} at B = {r['batch_size']}, T = {r['temperature']:g}: "
                       f"{r['speedup_vs_batched_ar']:.2f}x" + (f", per run {min(each):.2f}-{max(each):.2f}x" if each else ""))
    return out


def cmd_batch_bench(a, model, tok, prompts: list[dict], out: str, prompts_path: str) -> int:
    """The bench's --batch-sizes run: table on stdout, results.json and table.md in `out`, one JSON summary line."""
    import json
    import os
    import platform

    import transformers

    from selfspec.kernels import build as kernels_build
    from selfspec.streaming import encode_prompt

    encoded = [encode_prompt(tok, p["prompt"]) for p in prompts]
    temps = [a.temperature] if a.temperature is not None else a.temperatures
    base = dict(lookup_min_ngram=a.lookup_min_ngram, lookup_max_ngram=a.lookup_max_ngram, lookup_tokens=a.lookup_tokens,
                top_k=a.top_k, top_p=a.top_p, block_length=a.block_length, draft_lora=not a.no_draft_lora)
    t0 = time.time()
    rows = run_batch_bench(model, encoded, [p["id"] for p in prompts], a.batch_sizes, a.modes,
                           max_new_tokens=a.max_new_tokens, temperatures=temps, peers=tuple(a.peers), seed=a.seed,
                           profile=a.profile, base=base, repeats=a.repeats, control=a.control)
    table = batch_table(rows)
    floor = batch_floor_lines(rows)
    print(table + "\n\n" + "\n".join(floor))
    result = {"command": "python -m selfspec " + " ".join(a.argv),
              "settings": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
              "dtype": str(model.dtype), "device": str(model.device),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()},
              "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
              "prompts_file": os.path.abspath(prompts_path), "n_prompts": len(prompts),
              "wall_seconds": round(time.time() - t0, 1), "rows": rows, "kernels": kernels_build.state()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n\n" + "\n".join(floor) + "\n")
    keep = ("label", "temperature", "tokens_per_second", "speedup_vs_batched_ar", "speedup_vs_ar_b1", "speedup_vs_hf",
            "rows_equal_ar", "tau", "plan_hist")
    print(json.dumps({"out": out, "n_prompts": len(prompts), "wall_seconds": result["wall_seconds"],
                      "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
                               for r in rows]}))
    return 0

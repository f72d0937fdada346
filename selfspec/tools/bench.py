"""`python -m selfspec bench`: AR vs linear vs PRESTO on the same prompts, model and machine.

Every configuration runs on every prompt after a warm-up; greedy by default, in which case each
output is also checked token for token against AR. Prints a Markdown table, writes
results.json (settings, versions, per-prompt records) and, with matplotlib installed, PNG plots;
the last stdout line is one JSON summary.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace

from selfspec.engine.request.options import MODES, SCHEDULES, DecodeConfig
from selfspec.tools.bench_report import (CONTROL, _by_kind, _summed, _worst, aggregate, floor_lines,  # noqa: F401
                                         long_floor_lines, long_report, long_table, markdown_table,
                                         prompt_kind)  # (aggregate, prompt_kind: read from here)
from selfspec.tools.bench_common import check_out
from selfspec.tools.bench_grid import grid, label  # noqa: F401  (read from here)
from selfspec.tools.bench_prompts import META, bench_prompts, read_suite
from selfspec.tools.hindsight import replay_arg, replay_figures, replay_label, replay_lines
from selfspec.tools.peers import LLAMA_PEERS, llama_cpp_available, llama_cpp_crash

PEERS = ("hf", "hf-lookup") + LLAMA_PEERS


def run_bench(model, tokenizer, prompts: list[dict], configs: list[DecodeConfig], *, seed: int = 0,
              warmup_tokens: int = 8, progress: bool = True, peers: tuple[str, ...] = (),
              profile=None, gguf: str | None = None, baselines: dict | None = None, repeats: int = 1,
              ignore_eos: bool = False, control: bool = False, replay=None) -> list[dict]:
    """Run every config (and peer) on every prompt; returns one row per config with per-prompt records.
    `baselines` ({weight format: model}) add a greedy AR row in each of those formats
    (the transformers peers then run on the fp32 one when given: the checkpoint's own weights).
    `control`: each AR config runs twice, as two rows ("ar" the reference, `CONTROL` a row like
    any other), so the run shows what its own noise does to a ratio of two identical settings.

    Runs are interleaved by prompt (every row on prompt 1, then every row on prompt 2, ...), so
    a machine that slows down or speeds up during the run shifts all rows alike. Each record has
    the time to its first token and the decode after it (`ttft_seconds`, `decode_seconds`,
    `decode_tokens`); `ignore_eos`: every row decodes max_new_tokens (the long suite's timing).
    """
    import torch
    from tqdm import tqdm

    from selfspec.tools.peers import HFPeer, LlamaCppPeer
    from selfspec.engine.schedule.decoder import Decoder
    from selfspec.engine.forward.forward import FastForward
    from selfspec.engine.request.request import eos_ids
    from selfspec.streaming import encode_prompt

    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]
    replay_cost = None
    if replay is not None:
        from selfspec.engine.measure.cost import cost_model
        from selfspec.tools.hindsight import replayed

        replay_cost = cost_model(model, profile)
    temps = sorted({c.temperature for c in configs})
    base = configs[0]
    runners = [("cfg", (model, c, None)) for c in configs]
    runners += [("cfg", (model, c, CONTROL)) for c in configs if control and c.mode == "ar"]
    for fmt, m in (baselines or {}).items():
        runners.append(("cfg", (m, DecodeConfig(**{**base.__dict__, "mode": "ar", "plan": None, "temperature": 0.0}), fmt)))
    for name in peers:
        if name in LLAMA_PEERS:
            hp = LlamaCppPeer(gguf, prompt_lookup=10 if name == "llama.cpp-lookup" else 0)
        else:
            hp = HFPeer((baselines or {}).get("fp32", model), prompt_lookup=10 if name == "hf-lookup" else 0)
        runners += [("peer", (hp, t)) for t in temps]
    eos = set() if ignore_eos else eos_ids(model)
    no_eos = {"eos_token_id": []} if ignore_eos else {}
    warm = encoded[0][:256]
    for kind, r in runners:  # warm-up: (the start of) the first prompt, a few tokens, every row
        if kind == "cfg":
            for _ in Decoder(r[0], [warm], replace(r[1], max_new_tokens=warmup_tokens),
                             profile=profile if r[1].plan == "auto" else None, **no_eos):
                pass
        else:
            r[0].run(warm, max_new_tokens=warmup_tokens, temperature=r[1], top_p=base.top_p, top_k=base.top_k,
                     eos=eos, seed=seed)
    records = [[] for _ in runners]
    peer_errors: set[str] = set()
    bar = tqdm(total=len(runners) * len(prompts) * repeats, desc="bench", file=sys.stderr, disable=not progress)
    for p, ids in zip(prompts, encoded):
        # repeats > 1: every row again in mirrored order (A B C C B A), times and counts summed, so a
        # machine whose speed drifts while one prompt runs moves every row alike
        order = [i for r in range(repeats) for i in (range(len(runners)) if r % 2 == 0 else
                                                     reversed(range(len(runners))))]
        runs = [[] for _ in runners]
        for i in order:
            kind, r = runners[i]
            if kind == "cfg":
                m, cfg, _ = r
                gen = torch.Generator(device=m.get_input_embeddings().weight.device).manual_seed(seed)
                dec = Decoder(m, [ids], cfg, generators=[gen], profile=profile if cfg.plan == "auto" else None,
                              replay=replay if m is model else None, **no_eos)
                seen = []
                if replay is not None and m is model:  # each round's layout and cache, for its modeled cost
                    dec.on_round = lambda info, seen=seen: seen.append((info["layout"], info["c"]))
                t0 = first = time.perf_counter()
                for n, _ in enumerate(dec):
                    if n == 0:
                        first = time.perf_counter()  # the first yield is the prefill's first token
                end = time.perf_counter()
                out, st = dec.outputs[0], dec.stats[0]
                rec = {"id": p["id"], "token_ids": out, "ttft_seconds": first - t0, "decode_seconds": end - first,
                       "decode_tokens": max(0, len(out) - 1), **{k: getattr(st, k) for k in (
                    "new_tokens", "rounds", "forwards", "round_tokens", "seconds", "forward_seconds", "tree_seconds",
                    "accept_lengths", "oracle_lengths")}, "plan_hist": dict(st.plan_hist)}
                if seen:
                    rec.update(replayed(dec, cfg, seen, len(ids), replay_cost))
            else:
                failed = None
                try:
                    out, sec = r[0].run(ids, max_new_tokens=base.max_new_tokens, temperature=r[1], top_p=base.top_p,
                                        top_k=base.top_k, eos=eos, seed=seed)
                except Exception as e:  # a peer's own bug (llama-cpp-python's lookup fails past ~1k tokens) costs its row that prompt, not the run
                    failed, out, sec = f"{type(e).__name__}: {e}", [], 0.0
                    if failed not in peer_errors:
                        print(f"bench: {r[0].label()} failed on {p['id']} ({failed}); its row leaves that prompt out",
                              file=sys.stderr)
                    peer_errors.add(failed)
                rec = {"id": p["id"], "token_ids": out, "new_tokens": len(out), "seconds": sec}
                if failed is not None:
                    rec["failed"] = failed
                elif getattr(r[0], "first_token_seconds", None) is not None:
                    rec.update(ttft_seconds=r[0].first_token_seconds, decode_seconds=sec - r[0].first_token_seconds,
                               decode_tokens=max(0, len(out) - 1))
            if kind != "cfg" or r[0] is not model:
                # untimed, a few AR tokens of the default model: the first run of ours after a peer's ran
                # slower (its caches and tables cold), after the fp32 baseline's slower still (its weights
                # push ours out of the cache), and in the mirrored order that run is always the same row
                for _ in Decoder(model, [warm], DecodeConfig(mode="ar", max_new_tokens=warmup_tokens), **no_eos):
                    pass
            rec.update({k: p[k] for k in META if k in p})
            runs[i].append(rec)
            bar.update(1)
        for i, rs in enumerate(runs):
            records[i].append(_summed(rs))
    bar.close()
    rows = []
    for (kind, r), recs in zip(runners, records):
        if kind == "cfg":
            m, r, fmt = r
            mode = "hybrid" if r.mode == "presto" and r.lookup else r.mode
            if fmt == CONTROL:
                meta = {"label": CONTROL, "mode": CONTROL, "weights": FastForward.of(m).weights}
            else:
                meta = {"label": label(r) + (f" [{fmt}]" if fmt else ""), "mode": f"{mode} [{fmt}]" if fmt else mode,
                        "weights": fmt or FastForward.of(m).weights}
            meta.update(schedule=None if r.mode in ("ar", "auto", "lookup") else (r.schedule or "auto"),
                        budget=r.budget if r.mode == "presto" else None, temperature=r.temperature, config=r.__dict__)
        else:
            meta = {"label": r[0].label(), "mode": r[0].label(), "schedule": None, "budget": None,
                    "temperature": r[1], "config": {"peer": r[0].label(), "temperature": r[1]}}
        if replay is not None and kind == "cfg" and m is model:
            meta.update(label=meta["label"] + f" [{replay_label(replay.name)}]", replay=replay_label(replay.name))
        rows.append({**meta, "records": recs})
    for t in temps:
        ar = next((r for r in rows if r["mode"] == "ar" and r["temperature"] == t), None)
        ar_out = {x["id"]: x["token_ids"] for x in ar["records"]} if ar else {}
        for r in rows:
            if t == 0 and r["temperature"] == 0 and r["mode"] != "ar" and ar_out:
                for x in r["records"]:
                    x["matches_ar"] = x["token_ids"] == ar_out.get(x["id"])
    for r in rows:
        r.update(aggregate(r["records"]))
        if r.get("replay"):
            r.update(replay_figures(r["records"]))
    for r in rows:
        t = r["temperature"]
        ar_tps = next((x["tokens_per_second"] for x in rows if x["mode"] == "ar" and x["temperature"] == t), None)
        lin = next((x["tokens_per_second"] for x in rows if x["mode"] == "linear" and x["schedule"] == r["schedule"]
                    and x["temperature"] == t), None)
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar_tps if ar_tps else None
        r["speedup_vs_linear"] = r["tokens_per_second"] / lin if lin and r["mode"] in ("presto", "hybrid") else None
    _by_kind(rows)
    _worst(rows)
    return rows


def _default_gguf(a) -> str | None:
    """The default model's GGUF when the bench runs it (the llama.cpp peer's weights)."""
    from selfspec.checkpoint.registry import DEFAULT_MODEL

    if a.model not in (None, DEFAULT_MODEL) or os.environ.get("SELFSPEC_MODEL"):
        return None
    try:
        from selfspec.checkpoint.convert import smollm2_gguf

        return smollm2_gguf()
    except FileNotFoundError:
        return None


def cmd_bench(a) -> int:
    import torch
    import transformers

    from selfspec.checkpoint.model import default_model_dir
    from selfspec.loading import load

    batch, suite = bool(a.batch_sizes), a.suite
    if a.threads is not None:  # a thread sweep is one run per count, read side by side with `bench compare`
        if a.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if suite and (batch or a.prompts):
        raise ValueError("--suite runs its own prompts one at a time (not with --prompts or --batch-sizes)")
    if a.max_new_tokens is None:
        a.max_new_tokens = 96 if suite else 64
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if batch and (a.full or any(b < 1 for b in a.batch_sizes)):
        raise ValueError("--batch-sizes takes integers >= 1 and runs its own grid (not with --full)")
    if a.modes is None:
        a.modes = ["ar", "auto"] if batch else (
            ["ar", "auto", "lookup", "linear", "presto", "hybrid"] if a.full else ["ar", "auto", "lookup"])
    if a.limit is None:
        a.limit = 0 if suite else 16 if batch else 32 if a.full else 8
    allowed = MODES if batch else MODES + ("hybrid",)
    for m in a.modes:
        if m not in allowed:
            raise ValueError(f"unknown mode {m!r}{' for batches' if batch else ''}; expected some of {allowed}")
    if batch and "ar" not in a.modes:
        a.modes = ["ar"] + list(a.modes)  # the reference every row is checked against
    if a.control and "ar" not in a.modes:
        raise ValueError("--control runs the AR row a second time: it needs ar among --modes")
    if a.schedules is None:
        a.schedules = ["auto", "two-pass", "one-pass"] if a.full else ["auto"]
    for s in a.schedules:
        if s not in ("auto",) + SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; expected some of {('auto',) + SCHEDULES}")
    replay = replay_arg(a, batch)
    model_dir = a.model or default_model_dir()
    notes = []
    if suite:  # the shipped suite: `limit` prompts of each length
        from selfspec.data import long_suite_files

        prompts_path = os.path.dirname(long_suite_files()["1k"])
        prompts = read_suite(suite, a.limit)
    else:
        prompts_path, prompts = bench_prompts(a.prompts, model_dir)
        prompts = prompts[: a.limit] if a.limit else prompts
    gguf = a.gguf
    default_peers = a.peers is None and replay is None  # a replayed run compares our own rows
    if replay is not None and a.peers is None:
        a.peers, a.compare_weights = [], []
    if default_peers:  # transformers generate (greedy / sampled, prompt lookup); llama.cpp when installed
        llama = list(LLAMA_PEERS if suite else LLAMA_PEERS[:1])
        found = gguf or _default_gguf(a)
        if not llama_cpp_available():
            llama = []
            notes.append("llama.cpp rows skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
        elif not found:
            llama = []
            notes.append("llama.cpp rows skipped: no GGUF for this model (--gguf FILE)")
        elif llama and not batch and (crash := llama_cpp_crash(found)):
            llama = []
            notes.append(f"llama.cpp rows skipped: {crash}")
            print(f"bench: llama.cpp rows skipped: {crash}", file=sys.stderr)
        a.peers = ["hf"] if batch else llama if suite else ["hf"] + (["hf-lookup"] if a.full else []) + llama
        notes = notes if suite else []  # the other grids name llama.cpp only when it runs, as before
    for name in a.peers:
        if name not in (("hf",) if batch else PEERS):
            raise ValueError(f"unknown peer {name!r}{' for batches' if batch else ''}; expected some of "
                             f"{('hf',) if batch else PEERS}")
    if (batch or suite) and a.temperature is None and "--temperatures" not in a.argv:
        a.temperatures = [0.0]
    if set(LLAMA_PEERS) & set(a.peers):
        if not llama_cpp_available():  # asked for by name: an error before the model loads
            raise ValueError(f"the {sorted(set(LLAMA_PEERS) & set(a.peers))[0]} peer needs llama-cpp-python (pip "
                             "install llama-cpp-python; it compiles from source, ~20 min on 2 cores)")
        gguf = gguf or _default_gguf(a)
        if not gguf or not os.path.isfile(gguf):
            raise ValueError("the llama.cpp peer needs the model's GGUF: --gguf FILE (found by itself for the default model)")
        if not default_peers and (crash := llama_cpp_crash(gguf)):  # a crash in its C code would end the run
            raise ValueError(f"the llama.cpp peer cannot run here: {crash}")
    temps = [a.temperature] if a.temperature is not None else a.temperatures
    configs = []
    for t in temps:
        base = dict(lookup_min_ngram=a.lookup_min_ngram, lookup_max_ngram=a.lookup_max_ngram,
                    lookup_tokens=a.lookup_tokens, max_new_tokens=a.max_new_tokens, temperature=t, top_k=a.top_k, top_p=a.top_p, block_length=a.block_length,
                    group_size=a.group_size, group_nodes=a.group_nodes, tree_top_k=a.tree_top_k, lam=a.lam, rho=a.rho,
                    draft_lora=not a.no_draft_lora, budget=max(a.budgets), sampling=a.sampling)
        configs += grid(a.modes, a.schedules, a.budgets, base)
    if a.profile is not None:
        from selfspec.engine.measure.cost import CostModel

        CostModel.load(a.profile)  # a bad file fails before the model loads
    out = check_out(a.out)
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map,
                      kv_cache_dtype=a.kv_cache_dtype)
    from selfspec.kernels import build as kernels_build

    print("bench: " + kernels_build.summary(), file=sys.stderr)  # whether the C kernels run (results.json too)
    if batch:
        from selfspec.tools.bench_batch import cmd_batch_bench

        return cmd_batch_bench(a, model, tok, prompts, out, prompts_path)
    t0 = time.time()
    from selfspec.engine.forward.batch_forward import BatchForward
    from selfspec.engine.forward.forward import FastForward

    weights = FastForward.of(model).weights
    if default_peers and weights != "fp32" and not a.full:
        # transformers runs the checkpoint's fp32 weights, as the "ar [fp32]" row does: in the short
        # grid that row is the reference on those weights (and keeps the default under 5 min)
        a.peers = [p for p in a.peers if p != "hf"]
    baselines = {f: load(a.model, weights=f, device=a.device)[0] for f in (a.compare_weights or []) if f != weights}
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    rows = run_bench(model, tok, prompts, configs, seed=a.seed, peers=tuple(a.peers), profile=a.profile, gguf=gguf,
                     baselines=baselines, repeats=a.repeats, ignore_eos=bool(suite), control=a.control,
                     replay=replay)
    if suite:  # per length and split: time to first token, decode tok/s, greedy equality; floor per length
        table, floor = long_table(rows), long_floor_lines(rows)
    else:
        table, floor = markdown_table(rows), floor_lines(rows)
    table += "".join("\n\n" + line for line in floor[:1]) + "".join("\n" + line for line in floor[1:])
    table += "".join(("\n\n" if i == 0 else "\n") + f"note: {n}" for i, n in enumerate(notes))
    if replay is not None:  # every line says so: these are not the model's own drafts
        table = (f"{replay_label(replay.name)}: the draft marginals are the profile's, drawn against the AR output; "
                 f"speedups on the cost model are in AR steps, wall-clock ones are this machine's\n\n" + table
                 + "\n\n" + "\n".join(replay_lines(rows)))
    print(table)
    from selfspec.tools.bench_plot import plot

    pngs = plot(rows, out)
    result = {
        "command": "python -m selfspec " + " ".join(a.argv),
        "settings": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
        "model": os.path.abspath(model_dir), "dtype": str(model.dtype), "weights": weights, "device": str(model.device),
        "kv_cache": {"dtype": str(BatchForward.of(model).cache_dtype).replace("torch.", ""),
                     "bytes_per_token": BatchForward.of(model).cache_bytes(1, 1)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "prompts_file": os.path.abspath(prompts_path), "n_prompts": len(prompts), "wall_seconds": round(time.time() - t0, 1),
        "rows": rows, "plots": pngs, "notes": notes, "kernels": kernels_build.state(),
        "replay": None if replay is None else {"label": replay_label(replay.name), "top1": replay.top1,
                                               "rank2": replay.rank2},
    }
    if suite:
        result["suite"] = {"name": suite, "eos": "off: every row decodes max_new_tokens", "groups": long_report(rows)}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    summary = {"out": out, "n_prompts": len(prompts), "wall_seconds": result["wall_seconds"],
               "replay": None if replay is None else replay_label(replay.name),
               "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k in ("label", "tau", "tpf", "tokens_per_second", "speedup_vs_ar", "speedup_vs_linear",
                                  "oracle_tau", "matches_ar", "overhead_share", "tree_share", "temperature", "accept_by_depth",
                                  "plan_hist", "by_kind", "worst_vs_ar", "replay", "modeled_speedup",
                                  "hindsight_speedup", "of_hindsight", "hindsight_plan", "expected_speedup",
                                  "of_expected")} for r in rows]}
    print(json.dumps(summary))
    return 0

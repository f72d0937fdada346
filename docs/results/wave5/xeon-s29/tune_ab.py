"""The run loop funds_cap_ab.py, wake_ab.py and roi_ab.py share: each variant (a planner rule, "ar" for AR mode)
generates the tune prompts (128 tokens, seeds 0..), timed by kind (code / chat); every variant runs once untimed
(its planners learn on the prompts), then `reps` times in mirrored order (A B C, C B A, ...) in one process."""
import collections
import os
import time

from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))  # the checkout


def tune_prompts(kind: str = "") -> list[dict]:
    """The tune prompts whose id holds `kind` (all of them for "")."""
    return [p for p in read_prompts(os.path.join(ROOT, "benchmarks/tune_prompts.jsonl")) if kind in p["id"]]


def generate(model, tok, ps: list[dict], mode: str, T: float):
    """(seconds by kind, each prompt's tokens) of one pass over `ps`."""
    by, out = collections.Counter(), []
    for i, p in enumerate(ps):
        ids = encode_prompt(tok, p.get("prompt") or p["messages"])
        t0, toks = time.perf_counter(), []
        for _, chunk in Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i]):
            toks += list(chunk)
        by["code" if "code" in p["id"] else "chat"] += time.perf_counter() - t0
        out.append(toks)
    return by, out


def alternate(run, variants: list, reps: int, T: float) -> dict:
    """{variant: seconds by kind} summed over `reps` mirrored passes of `run(variant)` -> (by, tokens), after
    one untimed pass each; at T = 0 a variant whose tokens differ from AR's is said."""
    for v in variants:
        run(v)
    tot, ref = {v: collections.Counter() for v in variants}, None
    for r in range(reps):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            by, out = run(v)
            tot[v].update(by)
            if v == "ar" and ref is None:
                ref = out
            if T == 0 and ref is not None and out != ref:
                print("DIFFERENT TOKENS", v)
    return tot


def print_times(tot: dict, variants: list) -> None:
    """Each variant's seconds by kind and its AR / it ratios (the funds_cap_ab / wake_ab lines)."""
    ar = tot["ar"]
    for v in variants:
        t = tot[v]
        print(f"{str(v):6s} code {t['code']:.3f} s chat {t['chat']:.3f} s | auto/AR code {ar['code'] / t['code']:.3f}x "
              f"chat {ar['chat'] / t['chat']:.3f}x all {(ar['code'] + ar['chat']) / (t['code'] + t['chat']):.3f}x")

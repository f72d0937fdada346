"""Held-out AR perplexity of a model on the stdlib hold-out (the shipped model's card figure).

    python -m selfspec.training.evaluate [--model DIR] [--max-tokens 100000]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from selfspec.training.data import split_corpus


@torch.inference_mode()
def heldout_perplexity(model, tokenizer, *, window: int = 256, max_tokens: int = 100_000) -> dict:
    _, held = split_corpus()
    ids = []
    for _, text in held:
        ids.extend(tokenizer.encode(text))
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens + 1:
            break
    ids = torch.tensor(ids[: max_tokens + 1])
    nll, count = 0.0, 0
    for s in range(0, ids.numel() - 1, window):
        x = ids[s : s + window + 1]
        if x.numel() < 2:
            break
        logits = model(x[:-1][None]).logits[0].float()
        nll += F.cross_entropy(logits, x[1:], reduction="sum").item()
        count += x.numel() - 1
    return {"heldout_tokens": count, "heldout_ar_nll": nll / count, "heldout_ar_ppl": math.exp(nll / count),
            "window": window, "heldout_files": len(held)}


def main(argv=None):
    from selfspec.checkpoint.model import load

    ap = argparse.ArgumentParser(prog="python -m selfspec.training.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=100_000)
    a = ap.parse_args(argv)
    model, tok = load(a.model)
    print(json.dumps(heldout_perplexity(model, tok, max_tokens=a.max_tokens)))


if __name__ == "__main__":
    main()

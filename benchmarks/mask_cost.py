"""Per-round mask + position work at a long context, and the prefill's mask work.

    python benchmarks/mask_cost.py [--context 8192] [--budget 32] [--group 16] [--prompt 8192]

Round: a budget-N PRESTO tree (random marginals, 15 depths, top-4) with a mask group of G on
every node (the one-pass default, q = (N + 1) * (G + 1) query tokens) over c cached tokens.
`engine` is what a batch-1 round does (`masks.tree_block` + the request's reused `MaskBuffer`);
`full` builds the whole [q, c + q] mask (`masks.tree_and_groups`, what wave 1 did every round).
Prefill: the runtime runs the prompt with SDPA's causal flag (no mask tensor) and its first mask
group over the cache with no mask, so its mask work is the non-forward time of `_prefill`;
`full` is wave 1's prompt-as-a-tree layout. Medians of repeated runs, 1 thread.
"""

import argparse
import json
import statistics
import time

import torch

from selfspec.engine.batch_forward import MaskBuffer
from selfspec.engine.masks import tree_and_groups, tree_block
from selfspec.drafting.tree import build_tree, group_owners


def _median_ms(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lq = torch.randn(15, 64, generator=g).log_softmax(-1)
    vals, toks = lq.topk(4)
    tree = build_tree(1, vals, toks, budget=a.budget)
    owners = group_owners(tree, None)
    buf = MaskBuffer("cpu", torch.float32)
    c = a.context

    def engine_round():
        block, offsets = tree_block(tree.parents, tree.depths, owners, a.group)
        buf.view(c, block)
        return c + offsets

    q = len(tree) * (a.group + 1)
    out = {"context": c, "query_tokens": q, "tree_nodes": len(tree),
           "round_engine_ms": round(_median_ms(engine_round, a.repeats), 3),
           "round_full_mask_ms": round(_median_ms(lambda: tree_and_groups(c, tree.parents, tree.depths, owners, a.group),
                                                  max(3, a.repeats // 4)), 3)}
    # prefill: the engine's own prefill on a tiny model long enough for the prompt, minus its forwards
    from selfspec.checkpoint.config import NemotronLabsDiffusionConfig
    from selfspec.engine.options import DecodeConfig
    from selfspec.checkpoint.model import NemotronLabsDiffusionModel
    from selfspec.engine.decoder import Decoder

    L = a.prompt
    cfg = NemotronLabsDiffusionConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=2 * L + 1024, mask_token_id=4,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                       "original_max_position_embeddings": L + 512, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                       "llama_4_scaling_beta": 0.1})
    model = NemotronLabsDiffusionModel(cfg).eval()
    prompt = torch.randint(5, 64, (L,), generator=g).tolist()
    runs = []
    for _ in range(3):
        dec = Decoder(model, [prompt], DecodeConfig(mode="presto", max_new_tokens=4, group_size=a.group))
        dec.start()
        seq = dec.scheduler.waiting[0]
        t0 = time.perf_counter()
        dec.stepper.prefill([seq], 0)
        runs.append(time.perf_counter() - t0 - seq.stats.forward_seconds)
    out["prompt"] = L
    out["prefill_mask_work_ms"] = round(1e3 * statistics.median(runs), 3)
    t0 = time.perf_counter()
    lay = tree_and_groups(0, torch.arange(L) - 1, torch.arange(L), torch.tensor([L - 1]), a.group)
    out["prefill_full_mask_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
    out["prefill_full_mask_mib"] = round(lay.mask.numel() * 4 / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

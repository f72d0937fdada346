"""Learned prefix-alignment predictor h_phi for PRESTO: rho(t | path) ~= sigmoid(h_phi(features)).

    python -m selfspec.training.predictor collect [--model DIR] --out runs/predictor [--prompts N]
    python -m selfspec.training.predictor train --data runs/predictor [--model DIR]

Collection runs the target's tree verification over prompts from the *training* side of the
corpus (never the held-out files) and records, for every verified tree node and each of its K
candidate children, the drafting-time features below and the label: the probability that the
verifier accepts that candidate after this node's path. The verifier draws the target's token at
the node and accepts the child carrying it, so that probability is p_T(t | path), the target's
(temperature / top-k / top-p processed) distribution at the node: a soft label at T > 0, and at
T = 0 the greedy match "the target's argmax is that candidate" (0 or 1). (The seed's
min(1, p_T / q) is the acceptance of a rejection-sampling verifier; this one never rejects by
ratio, so its acceptance is p_T(t).) Training fits a 2-layer MLP with logistic loss (binary
cross-entropy on the soft labels) and writes
`presto_predictor.safetensors` + `presto_predictor.json` next to the model, where `load()` finds
them. At inference the builder calls the MLP once per expansion step on all [P, K] candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from selfspec.drafting.learned_rho import FEATURES, FILE, META, LearnedRho, Predictor, features, grid_features  # noqa: F401
from selfspec.drafting.scoring import Expansion

def acceptance_probs(node_logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     banned: int | None = None) -> torch.Tensor | None:
    """[n, V] probability that the verifier's draw at each node is each token; None at T = 0.

    The same processing as `sampling.select`, so a label is exactly the chance that the walk
    accepts a child carrying that token once it reaches the node. At T = 0 the draw is the
    argmax and the labels are the greedy match, which `round_examples` computes from the targets.
    Example: logits [[0, ln 3]] at T = 1 -> [[0.25, 0.75]]; at T = 0 -> None.
    """
    if temperature == 0:
        return None
    from selfspec.drafting.sampling import process_logits

    x = process_logits(node_logits, temperature=temperature, top_k=top_k, top_p=top_p, banned=banned)
    return x.softmax(-1).cpu()


def round_examples(tree, top_lq, top_tok, targets, entropy, history, ngram,
                   target_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, F], labels [M]) for every verified node with a next depth and its K candidates.

    Labels are `target_probs[node, candidate]` (the acceptance probability, `acceptance_probs`)
    when given, else the greedy match `targets[node] == candidate`.
    """
    D, K = top_tok.shape
    nodes = (tree.depths < D).nonzero().squeeze(-1)
    if nodes.numel() == 0:
        return torch.zeros(0, len(FEATURES)), torch.zeros(0)
    dep = tree.depths[nodes]
    tok = tree.tokens[nodes]
    par = tree.parents[nodes]
    w2 = torch.where(par >= 0, tree.tokens[par.clamp(min=0)], torch.tensor(history[0]))
    own_rank = torch.full((nodes.numel(),), -1.0)
    own_lq = torch.zeros(nodes.numel())
    deep = dep > 0
    if deep.any():
        hits = top_tok[dep[deep] - 1] == tok[deep][:, None]  # [m, K]
        own_rank[deep] = hits.float().argmax(-1).float()
        own_lq[deep] = top_lq[dep[deep] - 1].gather(1, hits.long().argmax(-1, keepdim=True)).squeeze(-1)
    feats, labels = [], []
    for d in dep.unique().tolist():
        sel = dep == d
        p = int(sel.sum())
        x = Expansion(d + 1, w2[sel][:, None].expand(p, K), tok[sel][:, None].expand(p, K), top_tok[d].expand(p, K),
                      top_lq[d].expand(p, K), torch.arange(K, dtype=torch.float32).expand(p, K),
                      own_lq[sel][:, None].expand(p, K), own_rank[sel][:, None].expand(p, K),
                      None if entropy is None else float(entropy[d]))
        feats.append(features(x, ngram).reshape(-1, len(FEATURES)))
        if target_probs is None:
            labels.append((targets[nodes[sel]][:, None] == top_tok[d][None, :]).float().reshape(-1))
        else:
            labels.append(target_probs[nodes[sel]][:, top_tok[d]].float().reshape(-1))
    return torch.cat(feats), torch.cat(labels)


def collect(model, tokenizer, prompts: list[str], out: str, *, max_new_tokens: int = 64, block_length: int = 16,
            budget: int = 48, tree_top_k: int = 4, shard_size: int = 16, temperature: float = 0.0,
            top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> int:
    """Run tree verification over prompts; shards of examples go to `out` (resumable).

    At temperature > 0 the trajectories are sampled (prompt i of shard s uses seed
    `seed + s * shard_size + i`, so a resumed run redraws the same shards) and the labels are
    acceptance probabilities; at 0 they are greedy matches.
    """
    from tqdm import tqdm

    from selfspec.engine.request.options import DecodeConfig
    from selfspec.engine.schedule.decoder import Decoder

    os.makedirs(out, exist_ok=True)
    # lambda = 0 trees (the marginals alone choose), with the n-gram context kept for the features
    cfg = DecodeConfig(mode="presto", schedule="two-pass", block_length=block_length, budget=budget,
                       tree_top_k=tree_top_k, lam=0.0, rho="ngram", max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p)
    mask_id = int(model.config.mask_token_id)
    device = model.get_input_embeddings().weight.device
    shards = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
    total = 0
    for si, shard in enumerate(tqdm(shards, desc="collect", unit="shard")):
        path = os.path.join(out, f"shard_{si:04d}.pt")
        if os.path.isfile(path):
            continue
        feats, labels = [], []

        def record(*args):
            *rest, node_logits = args
            probs = acceptance_probs(node_logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                     banned=mask_id)
            f, lab = round_examples(*rest, target_probs=probs)
            feats.append(f)
            labels.append(lab)

        for i, text in enumerate(shard):
            gen = torch.Generator(device=device).manual_seed(seed + si * shard_size + i)
            dec = Decoder(model, [tokenizer.encode(text)], cfg, generators=[gen])
            dec.recorder = record
            for _ in dec:
                pass
        torch.save({"x": torch.cat(feats), "y": torch.cat(labels), "temperature": temperature}, path + ".tmp")
        os.replace(path + ".tmp", path)
        total += int(torch.cat(labels).numel())
    return total


# -- training ------------------------------------------------------------------------------------
def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve; a soft label y counts as y of a positive and 1 - y of a negative.

    With 0/1 labels this is the rank-sum statistic. Soft labels (acceptance probabilities at
    T > 0) give the chance that a random accepted candidate outscores a random rejected one.
    Example: scores (0.1, 0.9, 0.2, 0.8), labels (0, 1, 0, 1) -> 1.0; labels (0.5, 0.5) -> 0.5.
    """
    order = scores.argsort()
    y = labels[order].double()
    neg_below = torch.cumsum(1 - y, 0) - (1 - y)  # negative mass strictly below each row
    pos_mass, neg_mass = float(y.sum()), float((1 - y).sum())
    # a row's pairing with itself is excluded: it adds y(1-y) to both sides of the count
    pairs = pos_mass * neg_mass - float((y * (1 - y)).sum())
    if pairs <= 0:
        return float("nan")
    return float((y * neg_below).sum() / pairs)


def reliability(prob: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> tuple[list[dict], float]:
    rows, ece = [], 0.0
    idx = (prob * bins).clamp(max=bins - 1).long()
    for b in range(bins):
        m = idx == b
        if m.any():
            p, o = float(prob[m].mean()), float(labels[m].mean())
            rows.append({"bin": b, "n": int(m.sum()), "predicted": round(p, 4), "observed": round(o, 4)})
            ece += int(m.sum()) / len(prob) * abs(p - o)
    return rows, ece


def train(x: torch.Tensor, y: torch.Tensor, *, hidden: int = 32, epochs: int = 300, lr: float = 1e-2,
          val_fraction: float = 0.1, val_index: torch.Tensor | None = None, inputs: list[str] = FEATURES,
          seed: int = 0) -> tuple[Predictor, dict]:
    """Fit the MLP (full-batch Adam); returns it with held-out AUC, log loss and calibration.

    `val_index` names the held-out rows (e.g. whole prompts); otherwise a random 10% is used.
    """
    g = torch.Generator().manual_seed(seed)
    if val_index is None:
        perm = torch.randperm(len(y), generator=g)
        val_index = perm[: max(1, int(len(y) * val_fraction))]
    is_val = torch.zeros(len(y), dtype=torch.bool)
    is_val[val_index] = True
    va, tr = is_val.nonzero().squeeze(-1), (~is_val).nonzero().squeeze(-1)
    n_val = len(va)
    torch.manual_seed(seed)
    model = Predictor(inputs, hidden)
    model.mean.copy_(x[tr][:, model.cols].mean(0))
    model.std.copy_(x[tr][:, model.cols].std(0).clamp(min=1e-4))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x[tr]), y[tr])
        loss.backward()
        opt.step()
    with torch.no_grad():
        logit = model(x[va])
        prob = torch.sigmoid(logit)
        rel, ece = reliability(prob, y[va])
        metrics = {"train_examples": len(tr), "val_examples": n_val, "positive_rate": round(float(y.mean()), 4),
                   "val_auc": round(auc(logit, y[va]), 4),
                   "val_log_loss": round(float(F.binary_cross_entropy_with_logits(logit, y[va])), 4),
                   "val_ece": round(ece, 4), "reliability": rel,
                   # single-feature baselines on the same rows: what the MLP adds
                   "val_auc_lq_only": round(auc(x[va, FEATURES.index("lq")], y[va]), 4),
                   "val_auc_ngram_only": round(auc(x[va, FEATURES.index("ngram")], y[va]), 4)}
    return model.eval(), metrics


def main(argv=None):
    from selfspec.training.data import function_prompts, split_corpus
    from selfspec.checkpoint.model import default_model_dir, load

    ap = argparse.ArgumentParser(prog="python -m selfspec.training.predictor", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="record (features, accepted?) from tree verification")
    c.add_argument("--model", default=None)
    c.add_argument("--out", required=True)
    c.add_argument("--prompts", type=int, default=256, help="training-side function prompts to use")
    c.add_argument("--prompt-file", default=None, help="JSONL prompts instead (e.g. for a real checkpoint)")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--block-length", type=int, default=16)
    c.add_argument("--budget", type=int, default=48)
    c.add_argument("--tree-top-k", type=int, default=4, help="PRESTO candidates per depth")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="sample the trajectories at this temperature; labels become acceptance probabilities")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default=None)
    c.add_argument("--dtype", default=None)
    t = sub.add_parser("train", help="fit the MLP and save it next to the model")
    t.add_argument("--data", required=True)
    t.add_argument("--model", default=None, help="where to save (default: the shipped model)")
    t.add_argument("--out", default=None, help="save here instead of next to the model")
    t.add_argument("--hidden", type=int, default=32)
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--exclude", nargs="*", default=[], choices=FEATURES, help="features the MLP does not see")
    a = ap.parse_args(argv)
    if a.cmd == "collect":
        if a.prompt_file:
            from selfspec.tools.bench_prompts import read_prompts

            prompts = [p["prompt"] for p in read_prompts(a.prompt_file) if isinstance(p["prompt"], str)]
        else:
            train_files, _ = split_corpus()
            prompts = [p["prompt"] for p in function_prompts(train_files, limit=a.prompts)]
        model, tok = load(a.model, dtype=a.dtype, device=a.device)
        n = collect(model, tok, prompts, a.out, max_new_tokens=a.max_new_tokens, block_length=a.block_length,
                    budget=a.budget, tree_top_k=a.tree_top_k, temperature=a.temperature, seed=a.seed)
        print(json.dumps({"examples_written": n, "out": a.out}))
    else:
        shards = sorted(f for f in os.listdir(a.data) if f.startswith("shard_") and f.endswith(".pt"))
        if not shards:
            raise SystemExit(f"error: no shard_*.pt files in {a.data}")
        parts = [torch.load(os.path.join(a.data, s)) for s in shards]
        x, y = torch.cat([p["x"] for p in parts]), torch.cat([p["y"] for p in parts])
        # validate on whole shards (whole prompts), not on rows of rounds seen in training
        n_val_shards = max(1, len(parts) // 8) if len(parts) > 1 else 0
        val_rows = sum(len(p["y"]) for p in parts[len(parts) - n_val_shards :])
        val_index = torch.arange(len(y) - val_rows, len(y)) if val_rows else None
        inputs = [f for f in FEATURES if f not in a.exclude]
        pred, metrics = train(x, y, hidden=a.hidden, epochs=a.epochs, val_index=val_index, inputs=inputs)
        metrics["val_shards"] = n_val_shards
        temps = sorted({float(p.get("temperature", 0.0)) for p in parts})
        metrics["labels"] = ("greedy match" if temps == [0.0] else
                             f"acceptance probability p_T(t) at temperature {', '.join(map(str, temps))}")
        target = a.out or a.model or default_model_dir()
        os.makedirs(target, exist_ok=True)
        pred.save(target, {"metrics": metrics, "data": a.data,
                           "command": "python -m selfspec.training.predictor " + " ".join(sys.argv[1:] if argv is None else argv)})
        print(json.dumps({k: v for k, v in metrics.items() if k != "reliability"}))


if __name__ == "__main__":
    main()

"""Render a combined tree-and-block mask with the project's own builder (docs/img/*.png).

    python examples/render_mask.py [--out docs/img/tree_and_block_mask.png]
"""

import argparse

import torch

from selfspec.engine.forward.masks import tree_and_groups
from selfspec.drafting.tree import Tree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/img/tree_and_block_mask.png")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # root r; depth 1: a, b; depth 2: a->c, a->d, b->e; depth 3: c->f  (7 nodes, groups of 3 on 3 nodes)
    tree = Tree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]),
                torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    names = ["r", "a", "b", "a.c", "a.d", "b.e", "a.c.f"]
    owners, G, prefix = torch.tensor([0, 1, 3]), 3, 4
    lay = tree_and_groups(prefix, tree.parents, tree.depths, owners, G)
    allowed = (lay.mask[0, 0] == 0).float()
    rows = names + [f"M{s + 1}|{names[o]}" for o in owners.tolist() for s in range(G)]
    cols = [f"p{i}" for i in range(prefix)] + rows
    fig, ax = plt.subplots(figsize=(9, 6.5))
    ax.imshow(allowed, cmap="Greens", vmin=0, vmax=1.3)
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{r}  @{p}" for r, p in zip(rows, lay.positions[0].tolist())], fontsize=7)
    for x in (prefix - 0.5, prefix + len(tree) - 0.5):
        ax.axvline(x, color="k", lw=0.8)
    ax.axhline(len(tree) - 0.5, color="k", lw=0.8)
    for j in range(1, len(owners)):
        ax.axhline(len(tree) + j * G - 0.5, color="gray", lw=0.5, ls="--")
    ax.set_title("one-pass round: accepted prefix | verification tree | mask groups (green = attend)\n"
                 "row labels show the explicit position id", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()

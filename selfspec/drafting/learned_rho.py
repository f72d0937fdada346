"""PRESTO's learned rho at inference: features, the 2-layer MLP and the score term.

rho(t | path) ~= sigmoid(h_phi(features)); `LearnedRho` evaluates it for one expansion step or
for a whole tree at once. This is the part the runtime needs; collection and training (which
run the runtime) live in `selfspec.training.predictor`, so nothing here imports upward.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from selfspec.drafting.scoring import Expansion

FEATURES = ["lq", "rank", "entropy", "depth", "parent_lq", "parent_rank", "ngram", "margin", "repeat"]
FILE, META = "presto_predictor.safetensors", "presto_predictor.json"


def features(x: Expansion, ngram) -> torch.Tensor:
    """[..., K, len(FEATURES)] drafting-time features of every candidate of an expansion step.

    The candidate axis is last; `x.depth` / `x.entropy` may be scalars or tensors that
    broadcast (the per-tree table passes one value per depth).
    Example: a root with candidates (7, 9) at depth 1, log q (-0.1, -2.5), entropy 1.2, gives rows
    [-0.1, 0, 1.2, 1, 0, -1, ngram, 0.0, 0] and [-2.5, 1, 1.2, 1, 0, -1, ngram, -2.4, 0].
    """
    shape = x.t.shape
    ng = ngram(x.w2, x.w1, x.t, 0) if ngram is not None else torch.zeros(shape)
    ent = torch.as_tensor(0.0 if x.entropy is None else x.entropy, dtype=torch.float32).expand(shape)
    depth = torch.as_tensor(x.depth, dtype=torch.float32).expand(shape)
    cols = [x.lq, x.rank, ent, depth, x.parent_lq, x.parent_rank, ng, x.lq - x.lq[..., :1], (x.t == x.w1).float()]
    return torch.stack([c.float() for c in cols], -1)


class Predictor(torch.nn.Module):
    """2-layer MLP on standardised features (all of FEATURES, or the subset `inputs`) -> logit."""

    def __init__(self, inputs: list[str] = FEATURES, hidden: int = 32):
        super().__init__()
        unknown = [i for i in inputs if i not in FEATURES]
        if unknown or not inputs:
            raise ValueError(f"predictor inputs must be a non-empty subset of {FEATURES}; got {inputs}")
        self.inputs = list(inputs)
        n = len(self.inputs)
        self.register_buffer("cols", torch.tensor([FEATURES.index(i) for i in self.inputs]), persistent=False)
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.fc1 = torch.nn.Linear(n, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """f [..., len(FEATURES)] -> logits [...]."""
        x = (f[..., self.cols] - self.mean) / self.std
        return self.fc2(torch.relu(self.fc1(x))).squeeze(-1)

    def save(self, dirpath: str, meta: dict) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(dirpath, FILE))
        with open(os.path.join(dirpath, META), "w") as f:
            json.dump({"features": FEATURES, "inputs": self.inputs, "hidden": self.fc1.out_features, **meta}, f, indent=1)

    @classmethod
    def load(cls, dirpath: str) -> "Predictor | None":
        """The predictor next to a model, None if there is none; a mismatched file is an error."""
        wpath, mpath = os.path.join(dirpath, FILE), os.path.join(dirpath, META)
        if not os.path.isfile(wpath):
            return None
        if not os.path.isfile(mpath):
            raise FileNotFoundError(f"{wpath} exists but {mpath} (feature names, normalisation) is missing")
        with open(mpath) as f:
            meta = json.load(f)
        if meta.get("features") != FEATURES:
            raise ValueError(f"{mpath}: features {meta.get('features')} do not match this selfspec's {FEATURES}; retrain it")
        from safetensors.torch import load_file

        inputs = meta.get("inputs", FEATURES)
        try:
            p = cls(inputs, int(meta.get("hidden", 32)))
            p.load_state_dict(load_file(wpath))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{wpath}: does not match a {len(inputs)}-input MLP as {mpath} describes: {e}") from None
        p.meta = meta
        return p.eval()


def grid_features(top_lq, top_tok, root: int, h2: int, entropy, ngram) -> torch.Tensor:
    """[D, K, K, K, F]: the features of every (depth, grandparent, parent, candidate) combination
    of one tree, indexed as `scoring.token_grid`; equal to `features` of the matching expansion."""
    from selfspec.drafting.scoring import token_grid

    D, K = top_tok.shape
    shape = (D, K, K, K)
    ranks = torch.arange(K, dtype=torch.float32)
    parent_rank = ranks[None, None, :, None].expand(shape).clone()
    parent_rank[0] = -1.0  # depth-1 candidates hang under the root
    parent_rows_lq = torch.cat([torch.zeros(1, K), top_lq[:-1]])  # the root's log q is 0
    per_depth = lambda v: v[:, None, None, None]  # noqa: E731
    x = Expansion(per_depth(torch.arange(1, D + 1)), *token_grid(top_tok, root, h2),
                  top_lq[:, None, None, :].expand(shape), ranks.expand(shape),
                  parent_rows_lq[:, None, :, None].expand(shape), parent_rank,
                  None if entropy is None else per_depth(entropy.float()))
    return features(x, ngram)


class LearnedRho:
    """log rho = log sigmoid(h_phi): one batched MLP call per tree (or per expansion step).

    The predictor runs in its own dtype and on its own device (fp32 on the CPU as loaded; the
    model's weight format is not its business): the fp32 features go to it, the scores come back
    as fp32 beside the features."""

    def __init__(self, predictor: Predictor, ngram):
        self.predictor, self.ngram = predictor, ngram
        w = next(predictor.parameters(), None)
        self._to = {} if w is None else {"device": w.device, "dtype": w.dtype}

    def _log_rho(self, f: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(self.predictor(f.to(**self._to)).to(f.device, torch.float32))

    @torch.inference_mode()
    def log_rho(self, x: Expansion) -> torch.Tensor:
        return self._log_rho(features(x, self.ngram))

    @torch.inference_mode()
    def log_rho_table(self, top_lq, top_tok, root: int, h2: int, entropy=None) -> torch.Tensor:
        return self._log_rho(grid_features(top_lq, top_tok, root, h2, entropy, self.ngram))


# -- collection ----------------------------------------------------------------------------------

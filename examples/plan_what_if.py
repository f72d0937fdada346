"""What would plan="auto" do on another device? Plan with this device's cost model, a flat
(GPU-like) one, and a hand-written cost-model file, and compare the layouts it picks.

    python examples/plan_what_if.py [--prompt "class Stack:\\n"] [--max-new-tokens 64]

Outputs are identical in every case (greedy): only the layouts, and so the speed, differ. A flat
profile on this CPU is only a what-if: the forwards still run here, so its tokens/s mean nothing.
"""

import argparse
import json
import os
import tempfile

import selfspec
from selfspec.engine.measure.cost import FORMAT, CostModel, cost_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", default="class Stack:\n")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    model, tok = selfspec.load()
    measured = cost_model(model)  # this device's cost model: cached, or measured now (a progress bar)
    # a hand-written file: a device where 16 query tokens per row cost as much as 1, then linear
    path = os.path.join(tempfile.mkdtemp(), "my_device.json")
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "device": "synthetic", "model": "*", "dtype": "any", "weights": "any",
                   "rows": [1], "widths": [1, 16, 576], "cache": [0], "seconds": [[[0.01, 0.01, 0.05]]]}, f)
    runs = {"this device": measured, "flat (GPU-like)": CostModel.flat(), "hand-written file": path}
    texts = set()
    for name, profile in runs.items():
        gen = selfspec.generate(model, tok, a.prompt, max_new_tokens=a.max_new_tokens, profile=profile)
        texts.add(gen.text)
        top = ", ".join(f"{k} x{v}" for k, v in gen.stats.plan_hist.most_common(4))
        print(f"{name:18s} tau {gen.stats.tau:.2f}  rounds {gen.stats.rounds:3d}  layouts: {top}")
    print("identical outputs:", len(texts) == 1)


if __name__ == "__main__":
    main()

"""rows_layout before (607ead2's masks.py and tree.py, checked out in BASE: `git worktree add BASE 607ead2`) and
after (this checkout's), alternating in one process: auto on the tune prompts of KIND (code / chat / "" for all) at
T, 128 tokens. BASE=/tmp/base python layout_ab.py KIND T REPEATS"""
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))  # the checkout
import importlib.util, sys, time, types
import selfspec.engine.step as step_mod
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts

def from_path(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

old_tree = from_path("old_tree", os.path.join(os.environ["BASE"], "selfspec/drafting/tree.py"))
sys.modules["selfspec.drafting.tree_old"] = old_tree
src = open(os.path.join(os.environ["BASE"], "selfspec/engine/masks.py")).read().replace(
    "from selfspec.drafting.tree import ancestors", "from selfspec.drafting.tree_old import ancestors")
old_masks = types.ModuleType("old_masks"); sys.modules["old_masks"] = old_masks; exec(compile(src, "old_masks", "exec"), old_masks.__dict__)
new_layout = step_mod.rows_layout
kind, T, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
model, tok = load(None, progress=False)
ps = [p for p in read_prompts(os.path.join(ROOT, "benchmarks/tune_prompts.jsonl")) if kind in p["id"]]
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in ps]
def run(layout):
    step_mod.rows_layout = layout
    out, t0 = [], time.perf_counter()
    for i, ids in enumerate(enc):
        toks = []
        for row, chunk in Decoder(model, [ids], DecodeConfig(mode="auto", max_new_tokens=128, temperature=T), seeds=[i]):
            toks += list(chunk)
        out.append(toks)
    return time.perf_counter() - t0, out
run(old_masks.rows_layout); run(new_layout)
tot = {"old": [], "new": []}
same = True
for r in range(reps):
    for name, lay in (("old", old_masks.rows_layout), ("new", new_layout)) if r % 2 == 0 else (("new", new_layout), ("old", old_masks.rows_layout)):
        s, toks = run(lay)
        tot[name].append(s)
        if name == "old" and r == 0: ref = toks
        same &= (toks == ref) if T == 0 else True
print(f"{kind or 'all'} T={T}: old {[round(x, 3) for x in tot['old']]} new {[round(x, 3) for x in tot['new']]}; "
      f"sum new/old {sum(tot['new']) / sum(tot['old']):.3f}, min {min(tot['new']) / min(tot['old']):.3f}; same tokens {same}")

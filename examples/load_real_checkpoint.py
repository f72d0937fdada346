"""Load a real Nemotron-Labs-Diffusion checkpoint directory (no remote code) and chat with it.

    python examples/load_real_checkpoint.py /models/Nemotron-Labs-Diffusion-8B [--device cuda]

Everything is read from the directory: config.json (NLD schema), sharded bf16 safetensors,
the tokenizer and its chat template, generation_config.json eos ids, linear_spec_lora/.
"""

import argparse

import selfspec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--device-map", default=None, help="e.g. auto, to spread a 14B over several GPUs")
    a = ap.parse_args()
    model, tok = selfspec.load(a.checkpoint, device=None if a.device_map else a.device, device_map=a.device_map)
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    gen = selfspec.stream(model, tok, messages, max_new_tokens=256, mode="presto", schedule="one-pass",
                          block_length=32, budget=32)
    for delta in gen:
        print(delta, end="", flush=True)
    print("\n", gen.stats.as_dict())
    # the upstream remote-code API works too: (ids including the prompt, number of forwards)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out, nfe = model.linear_spec_generate(ids.to(model.device), max_new_tokens=64, block_length=32)
    print(tok.decode(out[0, ids.shape[1]:]), f"[{nfe} forwards]")


if __name__ == "__main__":
    main()

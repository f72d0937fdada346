"""Peers on the same weights: transformers' own `generate`, greedy and with prompt lookup; and
llama.cpp on the original GGUF, plain and with its prompt-lookup decoding.

The checkpoint's backbone is a `Ministral3Model` and its head a plain linear layer, so
`Ministral3ForCausalLM` with those two modules *is* the model's AR reading, with no copy of the
weights. The bench times it next to selfspec's rows, on the same prompts, in the same run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

LLAMA_PEERS = ("llama.cpp", "llama.cpp-lookup")  # the bench's names for LlamaCppPeer, plain and prompt lookup


class _FirstToken:
    """A `generate` streamer that only notes when the first new token arrives (the first `put` is
    the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def causal_lm(model):
    """`Ministral3ForCausalLM` sharing `model`'s backbone and head (built on the meta device)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    keys = Ministral3Config.__dataclass_fields__
    cfg = Ministral3Config(**{k: v for k, v in model.config.to_dict().items() if k in keys})
    cfg._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        lm = Ministral3ForCausalLM(cfg)
    lm.model = model.encoder
    lm.lm_head = model.diffusion_head
    return lm.eval()


class HFPeer:
    """`generate` on the shared weights; `prompt_lookup` > 0 turns on prompt-lookup decoding."""

    def __init__(self, model, *, prompt_lookup: int = 0):
        self.lm = causal_lm(model)
        self.prompt_lookup = prompt_lookup
        self.device = model.get_input_embeddings().weight.device
        self.mask_id = int(model.config.mask_token_id)
        self.first_token_seconds: float | None = None  # of the last run

    def label(self) -> str:
        return "hf-generate" + (f"/lookup={self.prompt_lookup}" if self.prompt_lookup else "")

    def run(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
            eos: set[int], seed: int) -> tuple[list[int], float]:
        """(new token ids, seconds). Stops at eos like selfspec (the eos is kept)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(eos) or None, pad_token_id=0,
                  suppress_tokens=[self.mask_id])
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        torch.manual_seed(seed)
        first = _FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.lm.generate(ids, streamer=first, **kw)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sec = time.perf_counter() - t0
        self.first_token_seconds = None if first.at is None else first.at - t0
        return out[0, ids.shape[1]:].tolist(), sec


class LlamaCppPeer:
    """llama.cpp (`llama-cpp-python`) on the original GGUF: the number CPU users know.

    It runs the quantized weights (Q4_1 / Q8_0 for the default model) with its own kernels, so
    its greedy tokens may differ from the fp32 reference; the bench reports how often they match.
    Sampling: temperature / top-p / top-k as given, min-p off, no repetition penalty.
    `prompt_lookup` > 0: llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`,
    that many tokens drafted from the context), the row "llama.cpp-lookup".
    """

    def __init__(self, gguf_path: str, *, threads: int | None = None, prompt_lookup: int = 0):
        try:
            from llama_cpp import Llama
            draft = None
            if prompt_lookup:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
        except ImportError:
            raise ValueError(f"the {LLAMA_PEERS[bool(prompt_lookup)]} peer needs llama-cpp-python (pip install "
                             "llama-cpp-python; it compiles from source, ~20 min on 2 cores)") from None
        self.prompt_lookup = prompt_lookup
        self.first_token_seconds: float | None = None  # of the last run
        # logits_all with a draft model: llama-cpp-python (0.3.36) then keeps every position's logits
        # anyway, but sizes their buffer by logits_all as given (n_batch = 512 rows, not n_ctx), so a
        # prompt past 512 tokens failed ("could not broadcast input array from shape ...")
        self.llm = Llama(model_path=gguf_path, n_ctx=4096, n_threads=threads or torch.get_num_threads(),
                         verbose=False, draft_model=draft, logits_all=draft is not None)

    def label(self) -> str:
        return LLAMA_PEERS[bool(self.prompt_lookup)]

    def run(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
            eos: set[int], seed: int) -> tuple[list[int], float]:
        self.llm.set_seed(seed)
        # generate(reset=True) still reuses the longest prefix its cache holds from the last call (a
        # prompt run twice, or after the warm-up's first 256 tokens, skipped its prefill: its first
        # token came at once in half of a `--repeats 2` row's runs); an emptied cache makes every run prefill it all
        self.llm.reset()
        out: list[int] = []
        self.first_token_seconds = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, temp=temperature, top_p=top_p, top_k=top_k or 0, min_p=0.0,
                                     repeat_penalty=1.0, reset=True):
            if not out:
                self.first_token_seconds = time.perf_counter() - t0
            out.append(int(tok))
            if tok in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0


# a few greedy tokens through llama-cpp-python in a child process (argv: GGUF, threads)
_SMOKE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4, 5, 6, 7, 8], temp=0.0, reset=True)):
    if i >= 3:
        break
"""


# llama.cpp's CPU build without its AMX kernels (0.3.36 built so runs on a CPU with AMX-INT8)
_NO_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
           "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def llama_cpp_crash(gguf_path: str, *, threads: int | None = None, timeout: float = 300.0) -> str | None:
    """Why llama-cpp-python cannot run `gguf_path` here, or None when it can: a few tokens in a child
    process first, since a crash inside its C code would take the bench down with it (0.3.36 built
    for the CPU it runs on dies with SIGSEGV in its AMX kernels on Intel CPUs with AMX-INT8)."""
    cmd = [sys.executable, "-c", _SMOKE, gguf_path, str(threads or torch.get_num_threads())]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama-cpp-python did not decode 4 tokens of {os.path.basename(gguf_path)} in {timeout:.0f} s"
    if res.returncode == 0:
        return None
    if res.returncode < 0:
        try:
            sig = signal.Signals(-res.returncode).name
        except ValueError:
            sig = f"signal {-res.returncode}"
        hint = (f"; on CPUs with AMX a build without its AMX kernels runs: CMAKE_ARGS='{_NO_AMX}' pip install "
                "--force-reinstall --no-cache-dir llama-cpp-python") if _has_amx() else ""
        return f"llama-cpp-python crashed ({sig}) decoding 4 tokens of {os.path.basename(gguf_path)}{hint}"
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return f"llama-cpp-python failed on {os.path.basename(gguf_path)} (exit {res.returncode}: {last})"


def _has_amx() -> bool:
    from selfspec.kernels.build import cpu

    return " amx_int8" in cpu()


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None

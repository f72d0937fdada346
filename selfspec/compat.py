"""Upstream-compatible entry points (the remote-code API of NLD checkpoints), over the runtime.

Code written for `AutoModel.from_pretrained(..., trust_remote_code=True)` keeps working after
`import selfspec` and dropping `trust_remote_code`: the same methods exist on
`NemotronLabsDiffusionModel` with the same argument names and the same return value,
`(ids including the prompt [1, L + n], nfe)`, where nfe counts every model forward (prefill
included). All decoding is lossless: upstream's `threshold` (a confidence shortcut) is
accepted only at its default 0.0. `top_k` / `top_p` mean sampling, as in transformers; PRESTO's
candidates per depth are `tree_top_k`.
"""

from __future__ import annotations

import torch

from selfspec.engine.request.options import DecodeConfig, check_args, check_type
from selfspec.engine.schedule.decoder import generate_ids


def _prompt_list(prompt_ids) -> list[int]:
    try:
        t = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.dim() not in (1, 2) or t.numel() and (
            t.dtype in (torch.bool, torch.uint8) or t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"prompt_ids must be a LongTensor [1, L] or a list of int, got {type(prompt_ids).__name__}"
                        + (f" of {t.dtype} and shape {tuple(t.shape)}" if t is not None else ""))
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ValueError(f"batch size 1 only (as upstream); got prompt_ids of shape {tuple(t.shape)}")
        t = t[0]
    return t.tolist()


def _run(model, prompt_ids, cfg: DecodeConfig, eos_token_id: int | list[int] | None,
         mask_token_id: int | None = None, generator: torch.Generator | None = None):
    # the options went through DecodeConfig; the other arguments are typed here, from these annotations
    typed = check_args(_run, eos_token_id=eos_token_id, mask_token_id=mask_token_id, generator=generator)
    eos_token_id = typed["eos_token_id"]
    if mask_token_id is not None and int(mask_token_id) != int(model.config.mask_token_id):
        raise ValueError(f"mask_token_id {mask_token_id} differs from the checkpoint's {model.config.mask_token_id}")
    prompt = _prompt_list(prompt_ids)
    out, st = generate_ids(model, prompt, cfg, eos_token_id=eos_token_id, generator=generator)
    device = model.get_input_embeddings().weight.device
    return torch.tensor([prompt + out], device=device), st.forwards + st.prefill_forwards


def ar_generate(model, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, eos_token_id=None,
                top_k: int = 0, top_p: float = 1.0, **kw):
    cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    return _run(model, prompt_ids, cfg, eos_token_id, **kw)


def linear_spec_generate(model, prompt_ids, max_new_tokens: int = 128, block_length: int = 32, temperature: float = 0.0,
                         mask_token_id=None, eos_token_id=None, threshold: float = 0.0, schedule: str = "two-pass",
                         top_k: int = 0, top_p: float = 1.0, **kw):
    if check_type("threshold", threshold, float) != 0.0:
        raise ValueError("threshold != 0 trades exactness for speed; selfspec decodes losslessly only (threshold=0.0)")
    cfg = DecodeConfig(mode="linear", schedule=schedule, block_length=block_length, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p)
    return _run(model, prompt_ids, cfg, eos_token_id, mask_token_id, **kw)


def presto_spec_generate(model, prompt_ids, max_new_tokens: int = 128, block_length: int = 32, temperature: float = 0.0,
                         mask_token_id=None, eos_token_id=None, budget: int = 32, tree_top_k: int = 4, lam: float = 0.2,
                         rho: str = "ngram", schedule: str = "one-pass", top_k: int = 0, top_p: float = 1.0, **kw):
    """`top_k` / `top_p` filter sampling (transformers' meaning); `tree_top_k` is the tree's candidates per depth."""
    cfg = DecodeConfig(mode="presto", schedule=schedule, block_length=block_length, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p, budget=budget, tree_top_k=tree_top_k,
                       lam=lam, rho=rho)
    return _run(model, prompt_ids, cfg, eos_token_id, mask_token_id, **kw)


def attach(cls) -> None:
    """Give the model class upstream's remote-code methods (`model.ar_generate(ids, ...)` etc.).
    Attached from here, above the checkpoint layer, so the model module imports no decoder."""
    for fn in (ar_generate, linear_spec_generate, presto_spec_generate):
        setattr(cls, fn.__name__, fn)

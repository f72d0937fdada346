"""Synthetic models: NLD's published architectures with seeded random weights, for timing only.

    model, tok = selfspec.load("synthetic:nld-3b", weights="w4a8")   # NLD-3B's shapes, random weights
    model, tok = selfspec.load("synthetic:nld-8b", device="cuda")    # bf16 on a GPU
    model, tok = selfspec.load("synthetic:tiny", weights="int8")     # a small shape for tests

The shapes are the released configs' (`SHAPES`; the 8B's config.json and the 3B's sizes as
docs/models.md quotes them), with the upstream draft LoRA's form (o_proj, r = 128, alpha = 512)
filled with random numbers too. Nothing here is a trained model: the text it writes is noise, so a
synthetic model answers timing questions only (`selfspec profile`, bench rows, replayed acceptance)
and chat refuses it (`refuse`). Weights are made layer by layer directly in the requested format: a
matrix is drawn in row chunks of at most `CHUNK_ELEMS` fp32 numbers, each chunk quantized as soon as
it exists, so no whole fp32 (or bf16) copy of the model is ever held. In the packed formats (int8,
int4, w4a8) the transformers modules keep zero-byte placeholders of the right shape: the compact
forward reads the packed weights, and the transformers reference forward refuses to run
(`PackedOnlyLinear`) instead of multiplying by the placeholders.

The tokenizer (`SyntheticTokenizer`) is byte-level: byte b is id 256 + b, and any other id decodes as
"<id>", so prompts of any text encode and the output of a random model prints as what it is.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from selfspec.checkpoint.quant import INT_FORMATS, Int4Weight, Int8Weight, int4_fits, quantize
from selfspec.kernels import w4a8

PREFIX = "synthetic:"
# the fields every released NLD config shares (the 8B's config.json, ../shared spec)
_NLD = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072, hidden_act="silu",
            rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, sliding_window=None, tie_word_embeddings=False,
            max_position_embeddings=262144, bos_token_id=1, eos_token_id=11, mask_token_id=100, block_size=32,
            dlm_paradigm="bidirectional",
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=16384,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                 llama_4_scaling_beta=0.1))
SHAPES = {
    "nld-3b": dict(_NLD, hidden_size=3072, intermediate_size=9216, num_hidden_layers=26),
    "nld-8b": dict(_NLD, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34),
    # NLD's config at a small width, for tests and the GPU check's dry run
    "tiny": dict(_NLD, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096),
}
LORA = {"nld-3b": (128, 512.0), "nld-8b": (128, 512.0), "tiny": (16, 64.0)}  # (r, alpha) of the draft LoRA
CHUNK_ELEMS = 1 << 24  # fp32 numbers drawn at once (64 MB): bounds the transient memory of a build
BYTE_BASE = 256  # byte b is token id BYTE_BASE + b (above bos 1, eos 11 and mask 100)


def is_synthetic(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def shape_of(name: str) -> str:
    """The shape's key for "synthetic:<key>", or one ValueError naming the known ones."""
    key = name[len(PREFIX):] if is_synthetic(name) else name
    if key not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; expected one of "
                         f"{', '.join(PREFIX + k for k in SHAPES)}")
    return key


def config(name: str):
    from selfspec.checkpoint.config import NemotronLabsDiffusionConfig

    cfg = NemotronLabsDiffusionConfig(**SHAPES[shape_of(name)])
    cfg.name_or_path = PREFIX + shape_of(name)
    return cfg


def refusal(name: str, what: str) -> str:
    return (f"{name} is a synthetic model (seeded random weights, for timing only: its text is noise); {what} "
            f"refuses it. Use it with `selfspec profile`, `bench` or `generate --prompt` to time a model of its shape")


def refuse(model_or_name, what: str) -> None:
    """One ValueError when `model_or_name` (a name, or a model / tokenizer built here) is synthetic."""
    name = model_or_name if isinstance(model_or_name, str) else getattr(model_or_name, "selfspec_synthetic", None)
    if is_synthetic(name):
        raise ValueError(refusal(name, what))


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Every matrix the compact forward multiplies in one layer, fused as it fuses them
    (`engine.formats._linears`), plus the output head."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {"qkv": ((nq + 2 * nkv) * d, h), "self_attn.o_proj.weight": (h, nq * d), "gate_up": (2 * f, h),
            "mlp.down_proj.weight": (h, f), "diffusion_head.weight": (cfg.vocab_size, h)}


def weight_bytes(name: str, bytes_per_weight: float = 2.0) -> int:
    """Bytes of the weights one forward reads (every layer's matrices and the head; the embedding
    is a lookup) at `bytes_per_weight` (2: bf16)."""
    cfg = config(name)
    shapes = linear_shapes(cfg)
    per_layer = sum(n * k for key, (n, k) in shapes.items() if key != "diffusion_head.weight")
    n, k = shapes["diffusion_head.weight"]
    return int(bytes_per_weight * (cfg.num_hidden_layers * per_layer + n * k))


# -- building --------------------------------------------------------------------------------------
def build(name: str, *, fmt: str, device: str = "cpu", draft_lora: bool = True, seed: int = 0,
          progress: bool = True):
    """(model, tokenizer, packed) of the synthetic model `name` in weight format `fmt` on `device`:
    `packed` is {name: quantized weight} in `engine.formats._linears`' naming for the int formats
    (the caller attaches them, `loading.load`), None for fp32 / bf16 (the modules hold the weights)."""
    from accelerate import init_empty_weights
    from tqdm import tqdm

    from selfspec.checkpoint.model import NemotronLabsDiffusionModel

    key = shape_of(name)
    cfg = config(name)
    packed_fmt = fmt in INT_FORMATS
    if packed_fmt and not device.startswith("cpu"):
        raise ValueError(f"weights={fmt!r} runs on torch's CPU kernels; use fp32 or bf16 on {device}")
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    with init_empty_weights():  # parameters on the meta device (no memory); RoPE's buffers real
        model = NemotronLabsDiffusionModel(cfg)
    model.encoder.rotary_emb.to(device, dtype)  # as a loaded model's after `set_weights`
    draws = _Draws(seed, device)
    packed = {} if packed_fmt else None
    enc = model.encoder
    embed_fmt = "fp32" if fmt == "fp32" else "bf16"  # a lookup table: bf16 in every other format, as `set_weights`
    _put(enc.embed_tokens, "weight", draws.matrix((cfg.vocab_size, cfg.hidden_size), embed_fmt, std=1.0))
    _put(enc.norm, "weight", torch.ones(cfg.hidden_size, dtype=dtype, device=device))
    shapes = linear_shapes(cfg)
    bar = tqdm(enc.layers, desc=f"building {PREFIX}{key} ({fmt}, random weights)", file=sys.stderr,
               disable=not progress, leave=False)
    for i, layer in enumerate(bar):
        _layer(layer, f"encoder.layers.{i}.", shapes, fmt, packed, draws, dtype, device)
    bar.close()
    head = draws.matrix(shapes["diffusion_head.weight"], fmt, head=True)
    if packed_fmt:
        packed["diffusion_head.weight"] = head
        _placeholder(model.diffusion_head)
    else:
        _put(model.diffusion_head, "weight", head)
    if draft_lora:
        model.draft_lora = _draft_lora(model, key, draws)
    model.presto_predictor = None
    model.__dict__["selfspec_synthetic"] = PREFIX + key
    tok = SyntheticTokenizer(cfg, PREFIX + key)
    return model.eval(), tok, packed


def _layer(layer, pre: str, shapes: dict, fmt: str, packed: dict | None, draws: "_Draws", dtype, device) -> None:
    """One decoder layer's weights: norms of ones; the matrices packed (into `packed`, the modules
    get placeholders) or as the modules' own weights (fp32, bf16)."""
    for ln in (layer.input_layernorm, layer.post_attention_layernorm):
        _put(ln, "weight", torch.ones(ln.weight.shape, dtype=dtype, device=device))
    at, mlp = layer.self_attn, layer.mlp
    groups = {"qkv": (at.q_proj, at.k_proj, at.v_proj), "self_attn.o_proj.weight": (at.o_proj,),
              "gate_up": (mlp.gate_proj, mlp.up_proj), "mlp.down_proj.weight": (mlp.down_proj,)}
    for part, mods in groups.items():  # drawn fused in every format: fp32 is the packed formats' source
        w = draws.matrix(shapes[part], fmt)
        if packed is not None:
            packed[pre + part] = w
            for mod in mods:
                _placeholder(mod)
            continue
        for mod, piece in zip(mods, w.split([m.out_features for m in mods])):
            _put(mod, "weight", piece.contiguous() if len(mods) > 1 else piece)


class _Draws:
    """Seeded normal numbers on one device: the i-th tensor of a build has its own generator seeded
    from (seed, i), so a build is reproducible and a chunked draw needs no other state."""

    def __init__(self, seed: int, device: str):
        self.seed, self.device, self.count = seed, device, 0

    def _gen(self, device) -> torch.Generator:
        self.count += 1
        return torch.Generator(device).manual_seed(self.seed * 1_000_003 + self.count)

    def normal(self, shape, std: float, dtype) -> torch.Tensor:
        t = torch.randn(shape, generator=self._gen(self.device), device=self.device, dtype=dtype)
        return t.mul_(std)

    def matrix(self, shape: tuple[int, int], fmt: str, *, head: bool = False, std: float | None = None):
        """A weight [n, k] ~ N(0, std^2) (default 1/k) in format `fmt`: on a CPU drawn in fp32 row
        chunks, each converted as it is made (so fp32 is bitwise the packed formats' source); on a
        GPU drawn there."""
        n, k = shape
        std = k ** -0.5 if std is None else std
        if not str(self.device).startswith("cpu"):
            return self.normal(shape, std, torch.float32 if fmt == "fp32" else torch.bfloat16)
        gen = self._gen("cpu")
        return quantize_chunked(lambda r0, r1: torch.randn(r1 - r0, k, generator=gen).mul_(std), shape, fmt, head=head)


def quantize_chunked(rows, shape: tuple[int, int], fmt: str, *, head: bool = False, chunk_elems: int | None = None):
    """The matrix whose rows r0..r1 `rows(r0, r1)` makes (fp32), quantized to `fmt` chunk by chunk:
    bitwise what `quant.quantize` gives for the whole matrix (every format's packing is row-blocked:
    chunks are whole multiples of 64 rows), holding at most `chunk_elems` fp32 numbers at a time."""
    n, k = shape
    if fmt == "int4" and not int4_fits(torch.empty(n, k, device="meta")):
        fmt = "int8"  # as `quantize` does for the whole matrix; decided once, not per chunk
    step = max(64, (chunk_elems or CHUNK_ELEMS) // k // 64 * 64)
    pieces = []
    for r0 in range(0, n, step):
        pieces.append(quantize(rows(r0, min(n, r0 + step)), fmt, head=head))
        _release()
    return _cat(pieces)


def _release() -> None:
    """Give the freed chunk's pages back to the OS (glibc): without it, a chunk's fp32 temporaries
    freed between small persistent pieces fragment the heap and the resident size grew by several
    times the packed bytes per chunk (a build's peak then approached a whole fp32 copy)."""
    trim = _LIBC_TRIM[0] if _LIBC_TRIM else _load_trim()
    if trim is not None:
        trim(0)


_LIBC_TRIM: list = []


def _load_trim():
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        fn = None  # not glibc: nothing to trim
    _LIBC_TRIM.append(fn)
    return fn


def _cat(pieces: list):
    """Row chunks of one quantized (or plain) matrix, joined."""
    p = pieces[0]
    if len(pieces) == 1:
        return p
    rows = lambda: (sum(x.shape[0] for x in pieces), p.shape[1])  # noqa: E731
    cat = lambda attr, dim=0: torch.cat([getattr(x, attr) for x in pieces], dim)  # noqa: E731
    if isinstance(p, torch.Tensor):
        return torch.cat(pieces)
    if isinstance(p, Int8Weight):
        return Int8Weight(cat("q"), cat("scales"))
    if isinstance(p, Int4Weight):
        return Int4Weight(cat("packed"), cat("scales_zeros", 1), p.group, rows())
    if isinstance(p, w4a8.W8A8Weight):
        return w4a8.W8A8Weight(cat("packed"), cat("scale"), rows())
    if isinstance(p, w4a8.W4A8Weight):
        return w4a8.W4A8Weight(cat("packed"), rows())
    raise TypeError(f"cannot join chunks of {type(p).__name__}")


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    module._parameters[name] = nn.Parameter(value, requires_grad=False)


class PackedOnlyLinear(nn.Linear):
    """A Linear whose weight lives only packed (the compact forward's): its `weight` is a zero-byte
    placeholder of the right shape, so the transformers reference forward refuses to run."""

    def forward(self, x):
        raise RuntimeError("this synthetic model's weights exist only in their packed format (the compact "
                           "forward's); the transformers reference forward cannot run on it")


def _placeholder(mod: nn.Linear) -> None:
    mod.__class__ = PackedOnlyLinear
    _put(mod, "weight", torch.zeros((), dtype=torch.bfloat16).expand(mod.out_features, mod.in_features))


def _draft_lora(model, key: str, draws: _Draws):
    """The upstream adapter's form (o_proj on every layer), random: drafts pay its full cost."""
    from selfspec.checkpoint.lora import DraftLoRA

    r, alpha = LORA[key]
    weights = {}
    for i, layer in enumerate(model.encoder.layers):
        o = layer.self_attn.o_proj
        weights[i] = (draws.normal((r, o.in_features), o.in_features ** -0.5, torch.float32),
                      draws.normal((o.out_features, r), 0.1 * r ** -0.5, torch.float32))
    return DraftLoRA(model, weights, alpha / r)


# -- the tokenizer ---------------------------------------------------------------------------------
class SyntheticTokenizer:
    """Byte-level ids over a synthetic model's vocabulary (byte b = id BYTE_BASE + b; other ids print
    as "<id>"): honest about a random model's output, and any prompt text encodes. No chat template."""

    def __init__(self, cfg, name: str):
        if cfg.vocab_size < BYTE_BASE + 256:
            raise ValueError(f"{name}: a vocabulary of {cfg.vocab_size} ids has no room for the byte ids")
        self.name_or_path = self.selfspec_synthetic = name
        self.vocab_size = cfg.vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = cfg.bos_token_id, cfg.eos_token_id, None
        self.special = {cfg.bos_token_id, cfg.eos_token_id, cfg.mask_token_id}
        self.chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = False, return_tensors: str | None = None, **_):
        if not isinstance(text, str):
            raise TypeError(f"encode takes one string, got {type(text).__name__}")
        ids = ([self.bos_token_id] if add_special_tokens else []) + [BYTE_BASE + b for b in text.encode("utf-8")]
        if return_tensors == "pt":
            return torch.tensor([ids], dtype=torch.long)
        if return_tensors is not None:
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        return ids

    def __call__(self, text: str, *, return_tensors: str | None = None, **kw):
        from transformers import BatchEncoding

        ids = self.encode(text, add_special_tokens=kw.get("add_special_tokens", False), return_tensors=return_tensors)
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids) if return_tensors else
                              [1] * len(ids)})

    def decode(self, token_ids, skip_special_tokens: bool = True, **_) -> str:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        ids = [ids] if isinstance(ids, int) else ids
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.decode(row, skip_special_tokens) for row in ids]
        out, run = [], bytearray()
        for i in map(int, ids):
            if BYTE_BASE <= i < BYTE_BASE + 256:
                run.append(i - BYTE_BASE)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if not (skip_special_tokens and i in self.special):
                out.append(f"<{i}>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def batch_decode(self, sequences, skip_special_tokens: bool = True, **_) -> list[str]:
        rows = sequences.tolist() if hasattr(sequences, "tolist") else sequences
        return [self.decode(row, skip_special_tokens) for row in rows]

    def convert_ids_to_tokens(self, ids):
        return [self.decode([int(i)], skip_special_tokens=False) for i in ids]

    def apply_chat_template(self, *_, **__):
        raise ValueError(refusal(self.name_or_path, "a chat template"))

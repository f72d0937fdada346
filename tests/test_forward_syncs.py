"""A round's forward reads no tensor's value on the host: no `.item()`, `int(t)`, `bool(t)`,
`.tolist()`, `nonzero` or boolean indexing. On a GPU each of them is a device-to-host sync: the
host waits for the queue to drain every round, and a CUDA graph cannot capture the forward. What
the forward needs as numbers (positions, the RoPE tables' length, a mask's width) comes from host
data: the cache lengths are Python ints, and offsets built on the host are read there (`numpy()`,
which is no sync: it refuses a device tensor); offsets on a device are never read.

Checked on a CPU with a dispatch mode that records every op that would read a value back, over
each path a round takes: the float formats' layer body, the exact formats' (and w4a8's one C
call), one row and many, a prefill, a draft LoRA with its mask embedding, a joining chunk."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from selfspec.checkpoint.lora import DraftLoRA
from selfspec.drafting.tree import chain
from selfspec.engine.forward.batch_forward import BatchForward, Join
from selfspec.engine.forward.masks import rows_layout, tree_block

from conftest import tiny_model
from matrix import set_weights

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # a boolean index is a nonzero first


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value back to the host (and `Tensor.tolist`, which
    dispatches nothing)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen = []
        tolist = torch.Tensor.tolist

        def recorded(t):
            self.seen.append("tolist")
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", recorded)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in READS or packet in INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def prefilled():
    """fmt -> (forward, cache with three rows of other lengths prefilled, the model)."""
    made = {}

    def make(fmt):
        if fmt not in made:
            m = tiny_model(num_hidden_layers=3)
            if fmt != "fp32":
                set_weights(m, fmt)
            bf = BatchForward.of(m)
            cache = bf.new_cache(4, 64)
            for r, n in enumerate((5, 11, 8)):
                bf(torch.arange(n)[None] % 50 + 5, torch.arange(n)[None], cache, slice(r, r + 1), causal=True)
                cache.set_length(r, n)
            made[fmt] = bf, cache, m
        return made[fmt]

    return make


def _rounds(bf, cache):
    """(name, call) of the forwards a round runs: trees over three rows, AR over three, one row with
    and without a mask, a prefill."""
    lay = rows_layout([chain([7, 8, 9]), chain([8]), chain([9, 10])], [None] * 3, 1, mask_id=4)
    ar = rows_layout([chain([7]), chain([8]), chain([9])], [None] * 3, 1, mask_id=4)
    block, offsets = tree_block(torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]))
    return [("trees", lambda: bf(lay.tokens, lay.offsets, cache, slice(0, 3), block=lay.blocks)),
            ("ar", lambda: bf(ar.tokens, ar.offsets, cache, slice(0, 3))),
            ("one row, a tree", lambda: bf(torch.tensor([[7, 8, 9]]), offsets[None], cache, slice(1, 2),
                                          block=block[None])),
            ("one row, a draft pass", lambda: bf(torch.tensor([[7, 4, 4]]), torch.arange(3)[None], cache,
                                                slice(2, 3))),
            ("a prefill", lambda: bf(torch.arange(6)[None] + 5, torch.arange(6)[None], cache, slice(3, 4),
                                     causal=True))]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "w4a8", "int8+kv8"])
def test_a_rounds_forward_reads_nothing_back_to_the_host(fmt, prefilled, monkeypatch):
    bf, cache, _ = prefilled(fmt)
    for name, run in _rounds(bf, cache):
        with HostReads(monkeypatch) as reads:
            out = run()
        assert reads.seen == [], f"{fmt}, {name}: {reads.seen}"
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "w4a8"])
def test_a_drafting_round_with_the_lora_and_its_mask_embedding_reads_nothing_back(fmt, prefilled, monkeypatch):
    bf, cache, m = prefilled(fmt)
    c = m.config
    H, nq, nkv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"q_proj": (H, nq), "k_proj": (H, nkv), "v_proj": (H, nkv), "o_proj": (nq, H)}  # (in, out)
    g = torch.Generator().manual_seed(0)
    weights = {(i, name): (torch.randn(2, n_in, generator=g), torch.randn(n_out, 2, generator=g))
               for i in range(3) for name, (n_in, n_out) in shapes.items()}
    lora = DraftLoRA(m, weights, 0.5, mask_embedding=torch.randn(H, generator=g))
    try:
        toks = torch.tensor([[7, 4, 4, 4], [8, 4, 4, 4]])
        with HostReads(monkeypatch) as reads:
            out = bf(toks, torch.arange(4).expand(2, 4), cache, slice(0, 2), lora=lora, lora_rows=slice(1, None))
        assert reads.seen == [], reads.seen
        assert torch.isfinite(out).all()
    finally:
        lora.remove()


def test_a_round_with_a_joining_chunk_reads_nothing_back(prefilled, monkeypatch):
    bf, cache, _ = prefilled("bf16")
    lay = rows_layout([chain([7, 8]), chain([8])], [None] * 2, 1, mask_id=4)
    with HostReads(monkeypatch) as reads:
        h, chunk = bf(lay.tokens, lay.offsets, cache, slice(0, 2), block=lay.blocks,
                      join=Join(torch.arange(5)[None] + 9, slice(3, 4)))
    assert reads.seen == [], reads.seen
    assert torch.isfinite(h).all() and chunk.shape[:2] == (1, 5)


def test_the_check_sees_a_read_back(monkeypatch):
    t = torch.arange(6)
    with HostReads(monkeypatch) as reads:
        int(t.max())
        t[t > 2] = 0
        t[t > 0]
        t.tolist()
        t[1:3] = 0  # a slice and an integer index read nothing
        t[torch.tensor([0, 2])]
    assert len(reads.seen) == 4, reads.seen

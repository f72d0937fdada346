"""The runtime's forward (one cache row, as a batch-1 generation runs it) against transformers'
Ministral3Model (the reference), and the KV cache."""

import pytest
import torch

from selfspec.engine.forward.masks import MaskBuffer
from selfspec.engine.forward.cache import BatchKVCache
from selfspec.engine.forward.masks import additive, tree_block
from selfspec.drafting.tree import ancestors

from conftest import OneRow


def _ref(model, ids, pos, mask=None):
    with torch.inference_mode():
        return model(ids[None], position_ids=pos[None], attention_mask=mask).logits[0]


@pytest.mark.parametrize("fused", [True, False])
def test_causal_logits_equal_the_transformers_reference_past_the_original_context(model, fused, monkeypatch):
    monkeypatch.setattr("selfspec.engine.forward.forward.FUSE_MAX_PARAMS", 10**12 if fused else 0)
    ff = OneRow(model)
    assert ff.ff.fused is fused
    ids = torch.randint(5, 64, (40,))
    pos = torch.arange(30, 70)  # original max is 8: YaRN and the Llama-4 query scale both matter here
    h = ff(ids, pos, ff.new_cache(64), causal=True)
    assert (ff.logits(h) - _ref(model, ids, pos)).abs().max().item() <= 1e-5


def test_tree_and_group_rows_over_a_cache_equal_the_reference_with_the_full_mask(model):
    ff = OneRow(model)
    prefix = torch.randint(5, 64, (9,))
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    owners = torch.tensor([0, 3])
    block, offsets = tree_block(parents, depths, owners, 3)
    tokens = torch.cat([torch.randint(5, 64, (6,)), torch.full((6,), 4)])
    cache = ff.new_cache(21)
    ff(prefix, torch.arange(9), cache, causal=True)
    cache.commit(0, list(range(9)))
    ours = ff.logits(ff(tokens, offsets, cache, block=block))
    full = torch.cat([prefix, tokens])
    mask = torch.cat([torch.cat([additive(torch.ones(9, 9, dtype=torch.bool).tril()), torch.full((9, 12), float("-inf"))], 1),
                      torch.cat([torch.zeros(12, 9), block], 1)])
    ref = _ref(model, full, torch.cat([torch.arange(9), 9 + offsets]), mask[None, None])[9:]
    assert (ours - ref).abs().max().item() <= 1e-5
    assert cache.lengths == [9]


def test_each_tree_node_equals_its_path_recomputed_causally(model):
    ff = OneRow(model)
    prefix = torch.randint(5, 64, (5,))
    parents = torch.tensor([-1, 0, 0, 1, 1, 4])
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    tokens = torch.randint(5, 64, (6,))
    block, offsets = tree_block(parents, depths)
    cache = ff.new_cache(16)
    ff(prefix, torch.arange(5), cache, causal=True)
    cache.commit(0, list(range(5)))
    logits = ff.logits(ff(tokens, offsets, cache, block=block))
    anc = ancestors(parents)
    for v in range(6):
        path = anc[v].nonzero().squeeze(-1)
        seq = torch.cat([prefix, tokens[path]])
        assert torch.allclose(logits[v], _ref(model, seq, torch.arange(seq.shape[0]))[-1], atol=1e-5), v


def test_commit_of_a_tree_path_equals_a_cache_recomputed_on_that_path(model):
    ff = OneRow(model)
    ids = torch.randint(5, 64, (12,))
    parents = torch.tensor([-1, 0, 0, 2])
    depths = torch.tensor([0, 1, 1, 2])
    block, offsets = tree_block(parents, depths)
    cache = ff.new_cache(32)
    ff(ids[:8], torch.arange(8), cache, causal=True)
    cache.commit(0, list(range(8)))
    ff(ids[8:], offsets, cache, block=block)
    cache.commit(0, [0, 2, 3])
    fresh = ff.new_cache(32)
    kept = torch.cat([ids[:8], ids[8:][[0, 2, 3]]])
    ff(kept, torch.arange(11), fresh, causal=True)
    fresh.commit(0, list(range(11)))
    assert cache.lengths == fresh.lengths == [11]
    for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
        assert torch.allclose(a[:, :, :11], b[:, :, :11], atol=1e-5)


def test_a_read_only_pass_does_not_change_the_committed_prefix(model):
    ff = OneRow(model)
    ids = torch.randint(5, 64, (10,))
    cache = ff.new_cache(20)
    ff(ids, torch.arange(10), cache, causal=True)
    cache.commit(0, list(range(10)))
    before = [t[:, :, :10].clone() for t in cache.k + cache.v]
    ff(torch.full((5,), 4), torch.arange(5), cache)  # a draft pass: nothing committed
    assert cache.lengths == [10]
    assert all(torch.equal(a, t[:, :, :10]) for a, t in zip(before, cache.k + cache.v))
    nxt = ff.logits(ff(ids[:1], torch.tensor([0]), cache))
    assert torch.allclose(nxt[0], _ref(model, torch.cat([ids, ids[:1]]), torch.arange(11))[-1], atol=1e-5)


def test_mask_buffer_keeps_prefix_columns_zero_across_steps():
    buf = MaskBuffer("cpu", torch.float32)
    first = buf.view(3, torch.full((2, 2), float("-inf"))).clone()
    assert first.shape == (2, 5) and (first[:, :3] == 0).all() and (first[:, 3:] == float("-inf")).all()
    second = buf.view(5, torch.zeros(2, 2))
    assert second.shape == (2, 7) and (second == 0).all()  # the previous block was cleared


def test_kv_cache_commit_moves_accepted_rows_into_place():
    cache = BatchKVCache(["cpu"], 1, 2, 1, 8, torch.float32)
    cache.lengths[0] = 2
    rows = torch.arange(4, dtype=torch.float32)[None, None, :, None].expand(1, 1, 4, 2)
    cache.write(0, slice(0, 1), [2], rows, rows)
    cache.commit(0, [0, 2, 3])
    assert cache.lengths == [5]
    assert cache.k[0][0, 0, 2:5, 0].tolist() == [0.0, 2.0, 3.0]


def test_draft_lora_reaches_only_draft_rows(model):
    from selfspec.checkpoint.lora import DraftLoRA

    H, D = model.config.hidden_size, model.config.num_attention_heads * model.config.head_dim
    g = torch.Generator().manual_seed(0)
    weights = {i: (torch.randn(4, D, generator=g), torch.randn(H, 4, generator=g)) for i in range(model.config.num_hidden_layers)}
    lora = DraftLoRA(model, weights, 2.0)
    try:
        ff = OneRow(model)
        ids = torch.randint(5, 64, (6,))
        plain = ff.logits(ff(ids, torch.arange(6), ff.new_cache(8), causal=True))
        mixed = ff.logits(ff(ids, torch.arange(6), ff.new_cache(8), causal=True, lora=lora, lora_rows=slice(4, None)))
        assert torch.equal(plain[:4], mixed[:4])  # causal rows before the draft rows are untouched
        assert not torch.allclose(plain[4:], mixed[4:])
        # the reference path applies the same delta through o_proj hooks
        with lora.on(slice(4, None)):
            ref = _ref(model, ids, torch.arange(6))
        assert (mixed - ref).abs().max().item() <= 1e-4
    finally:
        lora.remove()


def test_a_dropped_model_is_freed_at_once_even_after_it_generated():
    """No reference cycle through the compact forward the model keeps: the last reference frees
    it without the cyclic collector (which a server freezes, and which a process may turn off)."""
    import gc
    import weakref

    import selfspec

    model, tok = selfspec.load("pystdlib-nld-9m", weights="int4", progress=False)
    selfspec.generate(model, tok, "import os\n", max_new_tokens=2, mode="ar")
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_the_weights_walk_lists_what_module_parameters_lists_and_the_key_sees_every_change():
    """`forward.parameters` is `list(model.parameters())` (a shared weight once, a module registered
    twice walked once), so `weights_key` sees every parameter: an in-place edit, a dtype move and a
    replaced layer each change it."""
    from selfspec.checkpoint.quant import parameters, weights_key
    from conftest import tiny_model

    m = tiny_model(seed=4, vocab_size=16)
    m.extra = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    m.extra[1].weight = m.extra[0].weight  # tied
    m.again = m.extra  # the same module under a second name
    want = list(m.parameters())
    got = parameters(m)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    key = weights_key(m)
    with torch.no_grad():
        m.extra[0].bias.add_(1.0)
    edited = weights_key(m)
    assert edited != key
    m.encoder.layers[-1].mlp.down_proj = torch.nn.Linear(*reversed(m.encoder.layers[-1].mlp.down_proj.weight.shape))
    replaced = weights_key(m)
    assert replaced != edited
    assert weights_key(m.to(torch.float64)) != replaced

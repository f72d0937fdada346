"""Exact by construction: in bf16, int8, int4 and w4a8, over the int16 cache and the one-byte (int8)
one, a row's logits are bitwise the same whatever the round's width, the tree, the padding and the
other rows of the batch, so every mode's greedy output equals AR's in every format; exact
attention sums do not depend on where the keys sit.
(bf16 on the tiny models' short rows: on CPUs with native bf16 dot products a long row is not
invariant, which `formats.invariant` finds on the real model; see test_quant.)"""

import pytest
import torch

from selfspec.drafting.tree import Tree, ancestors, chain
from selfspec.engine.forward.attention import exact_attention, grid_for, on_grid
from selfspec.engine.forward.batch_forward import BatchForward
from selfspec.engine.schedule.decoder import generate_batch_ids, generate_ids
from selfspec.engine.forward.masks import additive, rows_layout, tree_block
from selfspec.engine.request.options import DecodeConfig

from conftest import tiny_model
from matrix import EXACT_KV8, set_weights

NEG = float("-inf")


def test_exact_attention_does_not_depend_on_where_the_keys_sit_or_how_many_are_masked():
    """The same visible keys in another order, among masked ones, for one query among many:
    bitwise the same output (a float reduction over keys would move in its last bits)."""
    g = torch.Generator().manual_seed(0)
    grid = grid_for(16, 8.0, 8.0, 4.0, 1024)
    q = torch.randn(1, 4, 1, 16, generator=g) * 3
    k, v = torch.randn(1, 2, 50, 16, generator=g) * 3, torch.randn(1, 2, 50, 16, generator=g)
    kc, vc = on_grid(k, grid.qk), on_grid(v, grid.v)
    ref = exact_attention(on_grid(q, grid.qk), kc, vc, None, grid, torch.bfloat16)
    perm = torch.randperm(50, generator=g)
    pad = 37  # masked keys with huge values scattered among the visible ones
    big_k = torch.cat([kc[:, :, perm], on_grid(torch.full((1, 2, pad, 16), 7.9), grid.qk)], 2)
    big_v = torch.cat([vc[:, :, perm], on_grid(torch.full((1, 2, pad, 16), 3.9), grid.v)], 2)
    order = torch.randperm(50 + pad, generator=g)
    mask = torch.zeros(1, 1, 3, 50 + pad, dtype=torch.float64)
    mask[..., 50:] = NEG
    qs = on_grid(torch.cat([torch.randn(1, 4, 1, 16, generator=g), q, torch.randn(1, 4, 1, 16)], 2), grid.qk)
    out = exact_attention(qs, big_k[:, :, order], big_v[:, :, order], mask[..., order], grid, torch.bfloat16)
    assert torch.equal(out[:, :, 1:2], ref)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert torch.allclose(out[:, :, 1:2].float(), sdpa, atol=2e-2)  # and it is attention


def _prefilled(m, prompts):
    bf = BatchForward.of(m)
    cache = bf.new_cache(len(prompts), 200)
    for r, p in enumerate(prompts):
        bf(torch.tensor([p]), torch.arange(len(p))[None], cache, slice(r, r + 1), causal=True)
        cache.set_length(r, len(p))
    return bf, cache


@pytest.mark.parametrize("fmt", EXACT_KV8)
def test_a_rows_logits_are_bitwise_the_same_alone_in_a_wide_tree_and_in_a_batch(fmt):
    """Path root -> a -> b: AR computes it one token at a time; the same nodes inside a 16-node
    tree with mask groups, and inside a batch beside rows of other lengths and widths, give the
    same logits bit for bit."""
    m = set_weights(tiny_model(), fmt)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 64, (21,), generator=g).tolist()
    path = torch.randint(5, 64, (3,), generator=g).tolist()  # root, a, b
    bf, cache = _prefilled(m, [prompt])
    ar = []
    for i, t in enumerate(path):  # AR: one token per forward, committed
        ar.append(bf.logits(bf(torch.tensor([[t]]), torch.zeros(1, 1, dtype=torch.long), cache, slice(0, 1))[0]))
        cache.commit(0, [0])
    ar = torch.cat(ar)
    # a 16-node tree holding the path at nodes 0, 3, 9 among siblings, with groups on 5 nodes
    parents = torch.tensor([-1, 0, 0, 0, 1, 2, 3, 3, 4, 3, 6, 7, 8, 9, 9, 10])
    depths = torch.zeros(16, dtype=torch.long)
    for v in range(1, 16):
        depths[v] = depths[parents[v]] + 1
    tokens = torch.randint(5, 64, (16,), generator=g)
    tokens[[0, 3, 9]] = torch.tensor(path)
    tokens[[1, 2]] = torch.tensor([path[1] + 1, path[1] + 2]) % 59 + 5  # siblings of a: other tokens
    tree = Tree(tokens, parents, depths)
    owners = torch.tensor([0, 3, 5, 9, 12])
    for width in (0, 128):  # natural width, then padded
        bf, cache = _prefilled(m, [prompt, prompt[:9], torch.randint(5, 64, (30,), generator=g).tolist()])
        other = chain(tokens[:4])
        lay = rows_layout([tree, other, tree], [owners, None, owners[:2]], 4, 4, width=width)
        h = bf(lay.tokens, lay.offsets, cache, slice(0, 3), block=lay.blocks)
        got = bf.logits(h[0, [0, 3, 9]])
        assert torch.equal(got, ar), (fmt, width)
    assert bool(ancestors(parents)[9, 3]) and bool(ancestors(parents)[3, 0])


@pytest.mark.parametrize("fmt", EXACT_KV8)
@pytest.mark.parametrize("mode", [dict(mode="lookup"), dict(mode="linear", schedule="two-pass"),
                                  dict(mode="linear", schedule="one-pass", group_nodes=2),
                                  dict(mode="presto", schedule="two-pass", budget=12),
                                  dict(mode="presto", schedule="one-pass", budget=12, group_nodes=4),
                                  dict(mode="presto", schedule="one-pass", budget=12, lookup=True)])
def test_greedy_output_equals_ar_in_every_mode_and_format_alone_and_in_batches(fmt, mode):
    m = set_weights(tiny_model(seed=2, vocab_size=16), fmt)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 16, (n,), generator=g).tolist() for n in (4, 19, 9)]
    cfg = DecodeConfig(max_new_tokens=32, block_length=6, **mode)
    ar = [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=32), eos_token_id=[])[0] for p in prompts]
    assert [generate_ids(m, p, cfg, eos_token_id=[])[0] for p in prompts] == ar
    assert generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=2)[0] == ar


@pytest.mark.parametrize("fmt", EXACT_KV8)
def test_plan_auto_equals_ar_in_every_format_on_flat_and_steep_costs(fmt):
    from selfspec.engine.measure.cost import CostModel

    m = set_weights(tiny_model(seed=2, vocab_size=16), fmt)
    p = torch.randint(5, 16, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    for prof in (CostModel.flat(), CostModel.linear(per_token=1e-3, fixed=1e-2)):
        assert generate_ids(m, p, DecodeConfig(max_new_tokens=40, block_length=6), eos_token_id=[],
                            profile=prof)[0] == ar


def test_the_exact_path_is_the_one_that_runs_and_its_tree_mask_is_the_runtimes():
    m = set_weights(tiny_model(), "bf16")
    bf = BatchForward.of(m)
    assert bf.ff.exact and bf.new_cache(1, 8).dtype == torch.int16 and bf.ff.act == torch.float32
    block, _ = tree_block(torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]))
    assert torch.equal(block, additive(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)))


def _lora(m, seed=0):
    from selfspec.checkpoint.lora import TARGETS, DraftLoRA, module_of

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i, layer in enumerate(m.encoder.layers):
        for name in TARGETS:
            out_f, in_f = module_of(layer, name).weight.shape
            weights[(i, name)] = (torch.randn(2, in_f, generator=g), torch.randn(out_f, 2, generator=g) * 0.3)
    return DraftLoRA(m, weights, scale=0.5, mask_embedding=torch.randn(m.config.hidden_size, generator=g))


@pytest.mark.parametrize("fmt", EXACT_KV8)
@pytest.mark.parametrize("live, chunk", [(1, (1, 3)), (1, (1, 20)), (2, (2, 6)), (2, (1, 3))])
def test_a_prompt_chunk_joined_to_a_round_gives_every_row_the_bits_of_its_own_forward(fmt, live, chunk):
    """A round of one or two rows (a tree with mask groups under the draft LoRA, and a chain)
    and a prompt chunk for other cache rows (one row narrow enough for the one-call attention,
    one too wide for it, two rows of a padded chunk) run in one forward: the round's hidden
    states, the chunk's and every K/V they write are bitwise those of the two separate forwards."""
    from selfspec.engine.forward.batch_forward import Join

    m = set_weights(tiny_model(), fmt)
    lora = _lora(m)
    g = torch.Generator().manual_seed(5)
    k, c = chunk
    prompts = [torch.randint(5, 64, (n,), generator=g).tolist() for n in (17, 8)][:live]
    chunked = [torch.randint(5, 64, (n,), generator=g).tolist() for n in (11, 4)[:k]]
    tree = Tree(torch.randint(5, 64, (5,), generator=g), torch.tensor([-1, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 2, 2]))
    lay = rows_layout([tree, chain(torch.randint(5, 64, (3,), generator=g))][:live],
                      [torch.tensor([0, 3]), None][:live], 4, 4)
    N = lay.nodes
    tokens = torch.randint(5, 64, (k, c), generator=g)
    out = {}
    for joined in (False, True):
        bf, cache = _prefilled(m, prompts + chunked)
        kw = dict(block=lay.blocks, lora=lora, lora_rows=slice(N, None))
        rows = slice(live, live + k)
        if joined:
            h, hj = bf(lay.tokens, lay.offsets, cache, slice(0, live), join=Join(tokens, rows), **kw)
        else:
            h = bf(lay.tokens, lay.offsets, cache, slice(0, live), **kw)
            hj = bf(tokens, torch.arange(c).expand(k, c), cache, rows, causal=True)
        out[joined] = (h, hj, [t.clone() for t in cache.k + cache.v + cache.shifts])
    (h0, j0, kv0), (h1, j1, kv1) = out[False], out[True]
    assert torch.equal(h0, h1) and torch.equal(j0, j1)
    assert len(kv0) == len(kv1) and all(torch.equal(a, b) for a, b in zip(kv0, kv1))
    assert not torch.equal(h0[0, N:], BatchForward.of(m)(lay.tokens, lay.offsets, _prefilled(m, prompts)[1],
                                                       slice(0, live), block=lay.blocks)[0, N:])  # the LoRA ran


@pytest.mark.parametrize("fmt", EXACT_KV8)
def test_greedy_output_equals_ar_past_512_cached_keys_with_64_dim_heads_in_every_format(fmt):
    """The long-context attention paths (keys split over the threads from 512, the weighted sums'
    chunks and skipped high limbs, 512-bit scores: all for 64-dim heads) under real decoding: a
    token's logits after a 700-token prompt are bitwise the same alone (the split path) and at the
    root of a 6-token chain (the chunked one), and every mode's greedy output equals AR's, in every
    exact format."""
    m = set_weights(tiny_model(seed=3, vocab_size=16, hidden_size=128, intermediate_size=128, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=64, max_position_embeddings=1 << 16,  # V shifts all 0
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                "factor": float((1 << 16) // 8), "original_max_position_embeddings": 8,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}), fmt)
    g = torch.Generator().manual_seed(6)
    prompt = (torch.randint(5, 16, (60,), generator=g).repeat(12)[:700]).tolist()  # repeats: lookup chains
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bf = BatchForward.of(m)
        cache = bf.new_cache(1, 720)
        bf(torch.tensor([prompt]), torch.arange(700)[None], cache, slice(0, 1), causal=True)
        cache.set_length(0, 700)
        toks = torch.tensor([prompt[:6]])
        alone = bf.logits(bf(toks[:, :1], torch.zeros(1, 1, dtype=torch.long), cache, slice(0, 1))[0])
        causal = torch.full((6, 6), NEG).triu(1)[None]
        root = bf.logits(bf(toks, torch.arange(6)[None], cache, slice(0, 1), block=causal)[0, :1])
        assert torch.equal(alone, root)
        ar = generate_ids(m, prompt, DecodeConfig(mode="ar", max_new_tokens=20), eos_token_id=[])[0]
        for mode in (dict(mode="lookup"), dict(mode="presto", schedule="one-pass", budget=8, lookup=True)):
            cfg = DecodeConfig(max_new_tokens=20, block_length=6, **mode)
            assert generate_ids(m, prompt, cfg, eos_token_id=[])[0] == ar, mode
    finally:
        torch.set_num_threads(threads)

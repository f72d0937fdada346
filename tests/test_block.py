"""Every decoder layer in one C call (`kernels.layer.run_block`): in w4a8 on a CPU a narrow round runs its
layers in one call whose logits are bitwise the Python layer loop's, alone and in a batch of rows
of other lengths, with and without a mask, with a draft LoRA on the draft rows too; rounds it
does not take (too wide, a LoRA that covers part of a fused projection, a joining chunk, another
format) go through the loop."""

import pytest
import torch

from selfspec.engine.forward import forward as fw
from selfspec.engine.forward.batch_forward import BatchForward, set_kv_cache_dtype
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.engine.measure.formats import set_weights
from selfspec.engine.forward.forward import FastForward
from selfspec.engine.request.options import DecodeConfig
from selfspec.kernels import attn16
from selfspec.kernels import layer as kl

from conftest import tiny_model

pytestmark = pytest.mark.skipif(not kl.block_available(), reason="the C kernels are not built here")


@pytest.fixture
def calls(monkeypatch):
    """How many forwards the one call ran (a run that returned None does not count)."""
    n, run = [0], kl.run_block

    def counted(*a, **k):
        out = run(*a, **k)
        n[0] += out is not None
        return out

    monkeypatch.setattr(fw.kl, "run_block", counted)
    return n


def _model(fmt="w4a8", layers=3):
    m = tiny_model(seed=4, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms of their own (a fresh model's are all ones: a swapped norm would not show)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    set_weights(m, fmt)
    return m


def _two_rows(m, one_call: bool, n: int, short: int):
    """(forward, cache) with two rows prefilled n tokens, the second then cut to `short`; one call
    or (`_block = (None,)`: the weights "are not w4a8") the layer loop."""
    FastForward.of(m)._block = None if one_call else (None,)
    bf = BatchForward.of(m)
    cache = bf.new_cache(2, 64)
    prompt = torch.arange(5, 5 + n) % 50 + 4
    bf(prompt[None].expand(2, n).contiguous(), torch.arange(n)[None].expand(2, n), cache, slice(0, 2), causal=True)
    cache.set_length(0, n)
    cache.set_length(1, short)
    return bf, cache


def _rounds(m, one_call: bool):
    """Logits of rounds of width 1, 3, 8 and 16: two rows of different lengths with a causal block,
    then one of them alone without a mask."""
    bf, cache = _two_rows(m, one_call, 30, 23)
    out = []
    for w in (1, 3, 8, 16):
        toks = (torch.arange(w) * 7 % 50 + 4)[None].expand(2, w).contiguous()
        block = torch.full((w, w), float("-inf")).triu(1)[None].expand(2, w, w)
        out.append(bf.logits(bf(toks, torch.arange(w)[None].expand(2, w), cache, slice(0, 2), block=block)[0]))
        out.append(bf.logits(bf(toks[:1, :1], torch.zeros(1, 1, dtype=torch.long), cache, slice(1, 2))[0]))
    return out


@pytest.mark.parametrize("kv", ["int16", "int8"])
def test_the_one_call_gives_the_loops_bits_alone_and_in_a_batch(calls, kv):
    m = set_kv_cache_dtype(_model(), kv)
    assert BatchForward.of(m).new_cache(1, 4).dtype == getattr(torch, kv)
    fast = _rounds(m, True)
    assert calls[0] == 9  # the 30-token prefill and every round above took the one call
    slow = _rounds(m, False)
    assert calls[0] == 9
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_wide_rounds_and_other_formats_take_the_loop(calls):
    m = _model()
    bf = BatchForward.of(m)
    cache = bf.new_cache(1, 80)
    wide = attn16.direct_max() // 2 + 1  # 2 query heads a key head: one query past what the one call takes
    bf(torch.arange(wide)[None] % 50 + 4, torch.arange(wide)[None], cache, slice(0, 1), causal=True)
    assert calls[0] == 0
    cache.set_length(0, 20)
    bf(torch.tensor([[7]]), torch.zeros(1, 1, dtype=torch.long), cache, slice(0, 1))
    assert calls[0] == 1
    m8 = _model("int8")
    bf8 = BatchForward.of(m8)
    c8 = bf8.new_cache(1, 64)
    bf8(torch.arange(5, 25)[None], torch.arange(20)[None], c8, slice(0, 1), causal=True)
    c8.set_length(0, 20)
    bf8(torch.tensor([[7]]), torch.zeros(1, 1, dtype=torch.long), c8, slice(0, 1))
    assert calls[0] == 1


@pytest.mark.parametrize("kv", ["int16", "int8"])
@pytest.mark.parametrize("mode", ["ar", "lookup", "auto"])
def test_greedy_output_with_the_one_call_equals_the_loops(mode, calls, kv):
    m = set_kv_cache_dtype(_model(layers=2), kv)
    prompt = (torch.arange(5, 30) % 12 + 4).tolist()
    cfg = DecodeConfig(mode=mode, max_new_tokens=24, temperature=0.0, block_length=4)
    FastForward.of(m)._block = (None,)
    ref = generate_ids(m, prompt, cfg, eos_token_id=[])[0]
    assert calls[0] == 0
    FastForward.of(m)._block = None
    assert generate_ids(m, prompt, cfg, eos_token_id=[])[0] == ref
    assert calls[0] >= 10  # the rounds took the one call


def _lora(m, targets, rank, seed=0):
    from selfspec.checkpoint.lora import DraftLoRA, module_of

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i, layer in enumerate(m.encoder.layers):
        for name in targets:
            out_f, in_f = module_of(layer, name).weight.shape
            weights[(i, name)] = (torch.randn(rank, in_f, generator=g) * 0.2, torch.randn(out_f, rank, generator=g) * 0.2)
    return DraftLoRA(m, weights, scale=0.5, mask_embedding=torch.randn(m.config.hidden_size, generator=g))


def _lora_round(m, lora, one_call: bool):
    """Hidden states of a round of two rows x 6 query tokens whose last 4 are draft rows."""
    bf, cache = _two_rows(m, one_call, 20, 14)
    toks = torch.tensor([[9, 11, 3, 3, 3, 3], [17, 5, 3, 3, 3, 3]])
    block = torch.full((6, 6), float("-inf")).triu(1)[None].expand(2, 6, 6)  # no row sees the draft rows after it
    return bf(toks, torch.arange(6)[None].expand(2, 6), cache, slice(0, 2), block=block, lora=lora,
              lora_rows=slice(2, None))


@pytest.mark.parametrize("rank", [8, 3])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("o_proj",)], ids=["every module", "o_proj (upstream's)"])
def test_a_round_with_a_draft_lora_takes_the_one_call_with_the_loops_bits(calls, targets, rank):
    m = _model()
    lora = _lora(m, targets, rank)
    fast = _lora_round(m, lora, True)
    assert calls[0] == 2  # the prefill and the round
    slow = _lora_round(m, lora, False)
    assert torch.equal(fast, slow)
    lora.enabled = False
    plain = _lora_round(m, lora, True)
    assert torch.equal(plain[:, :2], fast[:, :2])  # rows before the draft rows: no delta
    assert not torch.equal(plain[:, 2:], fast[:, 2:])  # the draft rows: the delta is there


@pytest.mark.parametrize("targets", [("q_proj", "down_proj"), ("k_proj", "up_proj")])
def test_a_lora_on_part_of_a_fused_projection_takes_the_one_call_with_the_loops_bits(calls, targets):
    m = _model()
    lora = _lora(m, targets, 4)  # q (or k) without the rest of q|k|v: the fused output is partly covered
    fast = _lora_round(m, lora, True)
    assert calls[0] == 2  # the prefill and the round
    assert torch.equal(fast, _lora_round(m, lora, False))
    lora.enabled = False
    assert not torch.equal(_lora_round(m, lora, True), fast)


def test_a_partly_covered_group_gets_the_per_module_deltas_in_the_fused_output():
    """The layer loop's fused call on part of a group (q and v, not k) adds to each module's own
    columns what that module's tables add there alone (the torch twin), and leaves k's columns
    and the other rows alone."""
    from selfspec.checkpoint.lora import draft_rows
    from selfspec.kernels import w4a8

    m = _model()
    lora = _lora(m, ("q_proj", "v_proj"), 3)
    names, R, q = ("q_proj", "k_proj", "v_proj"), 2, 5
    cols = tuple(getattr(m.encoder.layers[0].self_attn, n).weight.shape[0] for n in names)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(R * q, m.config.hidden_size, generator=g).to(torch.bfloat16)
    out = torch.randn(R * q, sum(cols), generator=g).to(torch.bfloat16)
    fused, per_module = out.clone(), out.clone()
    lora.add_fused(0, names, x, fused, draft_rows(R, q, slice(2, None)), cols)
    rows = draft_rows(R, q, slice(2, None))
    for name, part in zip(names, per_module.split(cols, -1)):
        if name != "k_proj":
            w4a8.lora(x, *lora._modules(0, (name,), torch.device("cpu"))[0], part, rows, fallback=True)
    assert torch.equal(fused, per_module)
    k = slice(cols[0], cols[0] + cols[1])
    assert torch.equal(fused[:, k], out[:, k]) and torch.equal(fused.view(R, q, -1)[:, :2], out.view(R, q, -1)[:, :2])
    assert not torch.equal(fused, out)


@pytest.mark.parametrize("fmt", ["w4a8", "int8", "int4", "bf16", "fp32"])
@pytest.mark.parametrize("mode, made", [("presto", 1), ("linear", 1), ("ar", 0), ("lookup", 0)])
def test_a_decoder_that_drafts_makes_its_loras_tables_before_its_first_round(monkeypatch, mode, made, fmt):
    """22 ms on the default model: paid in a round, a generation's first probe cost 4x its
    prediction. w4a8 runs the one-call block (its pointer tables), the other formats the layer
    loop (A / B per layer and group: per module in the exact formats, stacked in fp32), and only
    the tables its path reads are made."""
    from selfspec.engine.schedule.decoder import Decoder

    layout = {"presto": dict(schedule="one-pass", budget=8, group_nodes=3, block_length=5),
              "linear": dict(schedule="one-pass", block_length=5)}.get(mode, {})  # rounds with mask groups

    m = _model(fmt)
    m.draft_lora = _lora(m, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4)
    tables, real = [], kl.block_lora
    monkeypatch.setattr(kl, "block_lora", lambda *a: tables.append(1) or real(*a))

    def made_now():
        made = m.draft_lora.__dict__  # the layer loop's tables: per module (exact formats) or stacked (fp32)
        return len(tables) if fmt == "w4a8" else len(made.get("_module_ab", {})) + len(made.get("_fused_ab", {}))

    dec = Decoder(m, [[5, 9, 11, 7]], DecodeConfig(mode=mode, max_new_tokens=6, **layout))
    before = made_now()
    assert before == (made if fmt == "w4a8" else made * 4 * len(m.encoder.layers))
    for _ in dec:
        pass
    assert made_now() == before and len(dec.outputs[0]) == 6

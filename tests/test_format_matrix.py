"""Every public option works in every weight format: one short generation per cell through the
public front door (`selfspec.generate`), in fp32, bf16, int8 and int4.

The cells cover each value of each option in each format (pairwise, not the full product): every
mode (ar, linear, presto, lookup, auto), both schedules and PRESTO laid out per round, every rho (none, ngram, learned), context
lookup on and off, both samplings at temperature 1 with a seed, and `trace=True`. Greedy output
equals AR's in that format (in bf16 / int8 / int4 by construction: a row's logits do not depend on
the round's width; bf16 included because the tiny model's rows are short, where even a CPU with
native bf16 dot products sums them in one order, as in test_invariance). Sampled output with a
seed: "reproducible" gives AR's tokens for that seed in every mode, "independent" repeats itself
with the same seed and layouts. Invalid combinations raise the ValueError the options document.

The model gets its learned-rho predictor before it is put in its format, as `selfspec.load` does:
the predictor must stay fp32 whatever the forward runs in (it failed in every format but fp32).
"""

import pytest
import torch

import selfspec
from selfspec.drafting.learned_rho import Predictor
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.measure.formats import set_weights

from conftest import tiny_model
from matrix import EXACT, FORMATS

V, MASK = 16, 4
NEW = 10
PROMPT = [5, 9, 7, 5, 9, 7, 11, 5, 9]  # repeats: lookup and the n-gram rho have something to find

# name -> (options, what the cell checks besides running)
CELLS = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup", lookup_min_ngram=1),
    "linear two-pass": dict(mode="linear", schedule="two-pass"),
    "linear one-pass trace": dict(mode="linear", schedule="one-pass", group_nodes=2, trace=True),
    "presto two-pass rho none": dict(mode="presto", schedule="two-pass", rho="none"),
    "presto two-pass rho learned": dict(mode="presto", schedule="two-pass", rho="learned"),
    "presto one-pass rho learned trace": dict(mode="presto", schedule="one-pass", rho="learned", group_nodes=3,
                                              trace=True),
    "presto one-pass rho ngram lookup": dict(mode="presto", schedule="one-pass", rho="ngram", lookup=True),
    "presto one-pass rho ngram no lookup": dict(mode="presto", schedule="one-pass", rho="ngram", lookup=False),
    "presto planned rho ngram": dict(mode="presto", rho="ngram"),  # no schedule: laid out per round
    "presto planned rho learned trace": dict(mode="presto", rho="learned", trace=True),
    "auto": dict(mode="auto"),  # n-gram rho, lookup on
    "auto rho learned trace": dict(mode="auto", rho="learned", trace=True),  # lookup off with it
    "auto rho none no lookup": dict(mode="auto", rho="none", lookup=False),
}
SAMPLED = {
    "presto one-pass rho learned": dict(mode="presto", schedule="one-pass", rho="learned"),
    "linear two-pass": dict(mode="linear", schedule="two-pass"),
    "presto planned": dict(mode="presto"),
    "auto rho ngram lookup": dict(mode="auto", rho="ngram", lookup=True),
    "auto rho learned trace": dict(mode="auto", rho="learned", trace=True),
}


class PieceTokenizer:
    """ids 0-4 are specials (decode to nothing); id i >= 5 is one letter."""

    eos_token_id = 2
    chat_template = None

    def decode(self, ids, skip_special_tokens=True, **_):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return "".join(chr(ord("a") + i) for i in ids if i >= 5)


TOK = PieceTokenizer()
_MODELS = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest)


def _model(fmt):
    """The tiny model with a (random) predictor attached, then put in `fmt`, as `selfspec.load`
    attaches the checkpoint's predictor before `set_weights`."""
    if fmt not in _MODELS:
        m = tiny_model(seed=2, vocab_size=V)
        torch.manual_seed(0)
        m.presto_predictor = Predictor().eval()
        _MODELS[fmt] = set_weights(m, fmt)
    return _MODELS[fmt]


def _planned(opts) -> bool:
    """plan "auto": the auto mode, or PRESTO with no layout named."""
    return opts.get("mode") == "auto" or (opts.get("mode") == "presto" and "schedule" not in opts
                                           and "group_nodes" not in opts)


def _run(m, opts, **kw):
    opts = {"block_length": 6, "budget": 8, "max_new_tokens": NEW, **opts, **kw}
    if _planned(opts):
        opts["profile"] = CostModel.flat()  # a flat cost: the planner lays out trees (and learned rho runs)
    return selfspec.generate(m, TOK, PROMPT, eos_token_id=[], **opts)


def _check_trace(gen, opts):
    if opts.get("trace"):
        assert gen.trace is not None and len(gen.trace.rounds) == gen.stats.rounds > 0
        assert gen.trace.token_ids == gen.token_ids


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_output_equals_ar_of_the_format_with_every_option(fmt, cell):
    m = _model(fmt)
    ar = _run(m, CELLS["ar"]).token_ids
    gen = _run(m, CELLS[cell])
    assert len(ar) == NEW and gen.token_ids == ar, (fmt, cell)
    _check_trace(gen, CELLS[cell])
    if CELLS[cell].get("rho") == "learned":
        assert m.presto_predictor.fc1.weight.dtype == torch.float32  # the format is the forward's, not rho's


WIDE_HEADS = dict(head_dim=32, max_position_embeddings=1 << 16, rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": float((1 << 16) // 8), "original_max_position_embeddings": 8,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})


@pytest.mark.parametrize("fmt", EXACT)
def test_greedy_output_equals_ar_with_the_integer_weighted_sums_in_every_exact_format(fmt):
    """The attention's weighted sums in int32 lanes (AVX-512 VNNI, `kernels/attn16_words.h`) run
    where heads are 32 dims wide and V's shifts agree, which the tiny model above never has (8-dim
    heads): this one has 32-dim heads and a long position range (a coarser V grid: every V shift
    0). Every mode gives AR's tokens in the format, and the same tokens with that path off."""
    from selfspec.kernels import attn16

    switch = attn16._fn("attn16_set_int_pv")
    if switch is None:
        pytest.skip("no attn16 kernel here")
    m = tiny_model(seed=2, vocab_size=V, **WIDE_HEADS)
    torch.manual_seed(0)
    m.presto_predictor = Predictor().eval()
    m = set_weights(m, fmt)
    cells = ["ar", "lookup", "presto one-pass rho ngram lookup", "linear two-pass", "auto"]
    outs = {}
    for on in (1, 0):
        before = switch(on)
        try:
            outs[on] = [_run(m, CELLS[c]).token_ids for c in cells]
        finally:
            switch(before)
    assert all(len(o) == NEW and o == outs[1][0] for o in outs[1]), (fmt, outs[1])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("cell", list(SAMPLED))
@pytest.mark.parametrize("fmt", FORMATS)
def test_sampling_with_a_seed_in_every_format(fmt, cell):
    """reproducible: AR's tokens for the seed in every mode; independent: the same tokens for the
    same seed (fixed layouts), valid ids, never the mask."""
    m, opts = _model(fmt), SAMPLED[cell]
    ar = _run(m, CELLS["ar"], temperature=1.0, seed=7).token_ids
    gen = _run(m, opts, temperature=1.0, seed=7)
    assert gen.token_ids == ar, (fmt, cell)
    _check_trace(gen, opts)
    ind = _run(m, opts, temperature=1.0, seed=7, sampling="independent").token_ids
    assert len(ind) == NEW and all(0 <= t < V and t != MASK for t in ind)
    if not _planned(opts):  # plan auto's layouts follow the clock; a fixed mode's do not
        assert _run(m, opts, temperature=1.0, seed=7, sampling="independent").token_ids == ind


@pytest.mark.parametrize("fmt", FORMATS)
def test_invalid_combinations_raise_the_documented_error_in_every_format(fmt):
    m = _model(fmt)
    for opts in (dict(mode="presto", schedule="one-pass", rho="learned", lookup=True),
                 dict(mode="auto", rho="learned", lookup=True)):
        with pytest.raises(ValueError, match="lookup candidates are scored with a token-level rho"):
            _run(m, opts)
    bare = set_weights(tiny_model(seed=2, vocab_size=V), fmt)  # no predictor
    with pytest.raises(ValueError, match="needs a trained predictor"):
        _run(bare, dict(mode="presto", schedule="two-pass", rho="learned"))


def test_the_predictor_is_not_part_of_the_model():
    """Attached, it stays out of the module tree: `model.to(...)` leaves it fp32 and its weights
    are not the model's (state_dict, save_pretrained)."""
    m = tiny_model(vocab_size=V)
    m.presto_predictor = Predictor().eval()
    m.to(torch.bfloat16)
    assert m.presto_predictor.fc1.weight.dtype == torch.float32
    assert not any(k.startswith("presto_predictor") for k in m.state_dict())
    assert all(mod is not m.presto_predictor for mod in m.modules())


def test_learned_rho_in_int4_equals_ar():
    """The shipped 9M model as `selfspec.load` gives it (its trained predictor attached, then int4):
    learned rho runs and its greedy output is int4 AR's, fixed layouts and plan auto."""
    m, tok = selfspec.load("pystdlib-nld-9m", weights="int4", progress=False)
    assert m.presto_predictor is not None and m.presto_predictor.fc1.weight.dtype == torch.float32
    prompt = "def add(a, b):\n"
    ar = selfspec.generate(m, tok, prompt, mode="ar", max_new_tokens=8).token_ids
    for opts in (dict(mode="presto", schedule="one-pass"), dict(mode="presto", schedule="two-pass"),
                 dict(mode="auto", profile=CostModel.flat())):
        gen = selfspec.generate(m, tok, prompt, rho="learned", max_new_tokens=8, **opts)
        assert gen.token_ids == ar, opts
        assert gen.stats.rounds > 0

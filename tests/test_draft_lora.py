"""The draft-LoRA distillation (selfspec.training.draft_lora) and the generalised adapter
(selfspec.checkpoint.lora): training forward vs the reference model, one step learns, resume is
exact, export -> load round trip, mismatched adapters refused, verification logits untouched."""

import json
import random

import pytest
import torch

from conftest import OneRow, tiny_model
from selfspec.checkpoint.lora import TARGETS, DraftLoRA, load_draft_lora
from selfspec.checkpoint.quant import FORMATS
from selfspec.engine.measure.formats import set_weights
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.engine.request.options import DecodeConfig
from selfspec.training.draft_lora import (Block, DraftParams, Frozen, Hyper, block_batch, block_logits, clean_pass,
                                          draft_loss, export, load_state, make_optimizer, sample_blocks, save_state,
                                          train_step)

T = 24


def _model():
    return tiny_model(seed=1, max_position_embeddings=64)


def _window(seed):
    return torch.randint(5, 64, (T,), generator=torch.Generator().manual_seed(seed))


def _reference_block_logits(model, window, blocks, mask_id=4):
    """NemotronLabsDiffusionModel.forward on [window ; blocks] with the equivalent 4-D float mask,
    built here from the rule: a block's rows see the clean tokens before the block and the whole
    block; a two-pass block is [x_{a-1}, masks at a..]; mask row p is read for token p."""
    ids, pos, spans, read = list(window.tolist()), list(range(T)), [], []
    for b in blocks:
        off = len(ids)
        if b.root:
            ids.append(int(window[b.a - 1]))
            pos.append(b.a - 1)
        for k in range(b.n_mask):
            read.append(len(ids))
            ids.append(mask_id)
            pos.append(b.a + k)
        spans.append((off, len(ids), b.a - 1 if b.root else b.a))
    n = len(ids)
    full = torch.full((n, n), float("-inf"))
    full[:T, :T] = torch.full((T, T), float("-inf")).triu(1)
    for off, end, ctx in spans:
        full[off:end, :ctx] = 0
        full[off:end, off:end] = 0
    out = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=full[None, None]).logits[0]
    return out[read]


def _randomise(params, seed=0, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in params.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * scale)
        params.mask_embedding.add_(torch.randn(params.mask_embedding.shape, generator=g))


def test_training_forward_equals_the_reference_forward_with_zero_lora():
    model = _model()
    fz, params = Frozen(model), DraftParams(model, r=4, alpha=8)
    w = _window(0)
    blocks = [Block(10, 6, False), Block(21, 2, True), Block(17, 5, True), Block(4, 8, False)]
    batch = block_batch(w, blocks, fz.mask_id)
    _, kvs = clean_pass(fz, w)
    with torch.no_grad():
        mine = block_logits(fz, params, batch, kvs, T)
        ref = _reference_block_logits(model, w, blocks)
    assert (mine - ref).abs().max().item() <= 1e-4


def test_one_step_lowers_the_loss_on_a_fixed_batch():
    model = _model()
    fz, params = Frozen(model), DraftParams(model, r=4, alpha=8)
    hp = Hyper(window=T, blocks=4, bmin=3, bmax=6, lr=1e-2, warmup=1, r=4, alpha=8)
    opt = make_optimizer(params, hp)
    w = _window(1)
    blocks = sample_blocks(random.Random(0), T, 4, 3, 6, 0.5)
    before = draft_loss(fz, params, w, blocks)[0].item()
    train_step(fz, params, opt, hp, 0, w, random.Random(0))  # the same blocks (same rng seed)
    after = draft_loss(fz, params, w, blocks)[0].item()
    assert after < before - 1e-3


def _steps(fz, params, opt, hp, start, n):
    for s in range(start, start + n):
        train_step(fz, params, opt, hp, s, _window(100 + s), random.Random(7 * s))


def test_resume_gives_the_identical_next_step(tmp_path):
    hp = Hyper(window=T, blocks=4, bmin=3, bmax=6, lr=1e-2, warmup=2, r=4, alpha=8)
    model = _model()
    fz = Frozen(model)
    torch.manual_seed(0)
    straight = DraftParams(model, hp.r, hp.alpha)
    opt = make_optimizer(straight, hp)
    _steps(fz, straight, opt, hp, 0, 3)

    torch.manual_seed(0)
    first = DraftParams(model, hp.r, hp.alpha)
    opt1 = make_optimizer(first, hp)
    _steps(fz, first, opt1, hp, 0, 2)
    path = str(tmp_path / "state.pt")
    save_state(path, first, opt1, hp, 2, {"tokens": 2 * T, "positions": 0, "seconds": 0.0})
    resumed, opt2, hp2, step, _ = load_state(path, model)
    assert step == 2 and hp2 == hp
    _steps(fz, resumed, opt2, hp2, step, 1)
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_export_load_round_trip_gives_the_same_deltas_and_logits(tmp_path):
    model = _model()
    fz, params = Frozen(model), DraftParams(model, r=4, alpha=8)
    _randomise(params)
    export(params, model, str(tmp_path / "linear_spec_lora"))
    cfg = json.loads((tmp_path / "linear_spec_lora" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == set(TARGETS)
    lora = load_draft_lora(model, str(tmp_path))
    try:
        assert lora.targets == TARGETS and lora.scale == params.scale
        for i in range(model.config.num_hidden_layers):
            for name in TARGETS:
                a, b = lora.ab[name][i]
                assert torch.equal(a, params.A[f"{i}_{name}"]) and torch.equal(b, params.B[f"{i}_{name}"])
        assert torch.equal(lora.mask_embedding, params.mask_embedding)
        # one two-pass block [x_9, M, M, M] after the window's first 9 tokens: training forward,
        # the runtime's compact forward and the hook-based reference agree
        w = _window(2)
        batch = block_batch(w, [Block(10, 3, True)], fz.mask_id)
        _, kvs = clean_pass(fz, w)
        with torch.no_grad():
            mine = block_logits(fz, params, batch, kvs, T)
        ff = OneRow(model)
        cache = ff.new_cache(T + 8)
        ff(w[:9], torch.arange(9), cache, causal=True)
        cache.commit(0, list(range(9)))
        toks = batch[0]
        fast = ff.logits(ff(toks, torch.arange(4), cache, lora=lora, lora_rows=slice(0, None)))[1:]
        assert (mine - fast).abs().max().item() <= 1e-4
        mask = torch.zeros(13, 13)
        mask[:9, :9] = torch.full((9, 9), float("-inf")).triu(1)
        mask[:9, 9:] = float("-inf")
        with torch.no_grad(), lora.on(slice(9, None)):
            ref = model(torch.cat([w[:9], toks])[None], attention_mask=mask[None, None]).logits[0, 10:]
        assert (mine - ref).abs().max().item() <= 1e-4
    finally:
        lora.remove()


def _export(tmp_path, model, **cfg_edit):
    params = DraftParams(model, r=4, alpha=8)
    export(params, model, str(tmp_path / "linear_spec_lora"))
    p = tmp_path / "linear_spec_lora" / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(cfg_edit)
    p.write_text(json.dumps(cfg))
    return str(tmp_path)


def test_mismatched_adapters_are_refused_by_name(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match=r"q_proj layer 0 lora_A \(4, 32\).*r=8"):
        load_draft_lora(model, _export(tmp_path / "rank", model, r=8))
    with pytest.raises(ValueError, match="base_model_hash"):
        load_draft_lora(model, _export(tmp_path / "hash", model, base_model_hash="0" * 40))
    other = tiny_model(seed=2, max_position_embeddings=64)  # same shapes, other weights
    with pytest.raises(ValueError, match="base_model_hash"):
        load_draft_lora(other, _export(tmp_path / "base", model))
    with pytest.raises(ValueError, match="unsupported target module 'lm_head'"):
        load_draft_lora(model, _export(tmp_path / "target", model, target_modules=["q_proj", "lm_head"]))
    assert load_draft_lora(model, _export(tmp_path / "ok", model)) is not None


def _full_lora(model, seed=0):
    params = DraftParams(model, r=4, alpha=8)
    _randomise(params, seed, scale=0.5)
    w = {(int(k.split("_", 1)[0]), k.split("_", 1)[1]): (params.A[k].detach(), params.B[k].detach()) for k in params.A}
    return DraftLoRA(model, w, params.scale, mask_embedding=params.mask_embedding.detach())


def test_verification_logits_are_unchanged_by_an_adapter_on_every_target():
    model = _model()
    lora = _full_lora(model)
    try:
        ff = OneRow(model)
        prefix = torch.randint(5, 64, (7,))
        # a mixed step: 4 verification rows (causal), then 4 mask rows seeing them and each other
        toks = torch.cat([torch.randint(5, 64, (4,)), torch.full((4,), 4)])
        block = torch.full((8, 8), float("-inf")).triu(1)
        block[4:, 4:] = 0
        out = []
        for use in (None, lora):
            cache = ff.new_cache(32)
            ff(prefix, torch.arange(7), cache, causal=True)
            cache.commit(0, list(range(7)))
            out.append(ff.logits(ff(toks, torch.arange(8), cache, block=block, lora=use,
                                    lora_rows=slice(4, None) if use else None)))
        assert torch.equal(out[0][:4], out[1][:4])
        assert (out[0][4:] - out[1][4:]).abs().max() > 1e-3
    finally:
        lora.remove()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
def test_greedy_with_a_full_adapter_still_equals_ar(schedule, fmt):
    """In every weight format: the exact ones add the LoRA on int8 tables (the one-call block in
    w4a8, the layer loop in the others), fp32 in torch."""
    model = set_weights(_model(), fmt)
    model.draft_lora = _full_lora(model, seed=3)
    try:
        prompt = [8, 9, 10, 11, 12]
        ar, _ = generate_ids(model, prompt, DecodeConfig(mode="ar", max_new_tokens=24), eos_token_id=[])
        cfg = DecodeConfig(mode="linear", schedule=schedule, block_length=6, max_new_tokens=24)
        assert generate_ids(model, prompt, cfg, eos_token_id=[])[0] == ar
    finally:
        model.draft_lora.remove()


def test_greedy_windows_are_reproducible_and_leave_the_old_stream_alone(tmp_path):
    from selfspec.training import draft_data

    class Tok:  # only the stdlib windows need a tokenizer; a byte one is enough to compare streams
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text.encode())}

        def apply_chat_template(self, msgs, tokenize=True, return_dict=False):
            return list("".join(m["content"] for m in msgs).encode())

    path = tmp_path / "greedy.jsonl"
    rows = [{"i": i, "kind": "code", "ids": list(range(1000 + 50 * i, 1000 + 50 * i + 40)), "n_prompt": 5}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"i": 6, "ids": [1, 2')  # a torn last line
    draft_data.greedy_records.cache_clear()
    assert len(draft_data.greedy_records(str(path))) == 6
    tok = Tok()
    plain = [draft_data.train_window(tok, 0, s, 64)[0] for s in range(6)]
    assert [draft_data.train_window(tok, 0, s, 64, 0.5, str(path), 0.0)[0] for s in range(6)] == plain
    mixed = [draft_data.train_window(tok, 0, s, 64, 0.5, str(path), 0.5)[0] for s in range(12)]
    assert mixed == [draft_data.train_window(tok, 0, s, 64, 0.5, str(path), 0.5)[0] for s in range(12)]
    greedy = [w for w in mixed if all(t >= 1000 for t in w)]
    assert 0 < len(greedy) < 12 and all(len(w) == 64 for w in greedy)
    for w in greedy:  # packed from records: consecutive ids inside a record
        assert sum(b == a + 1 for a, b in zip(w, w[1:])) >= 64 - 1 - 64 // 40 - 1

"""One model, many callers: generations in several threads equal their sequential runs, and the
engine follows `model.to(...)`."""

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import selfspec
from conftest import SHIPPED, tiny_model
from selfspec.checkpoint.lora import DraftLoRA

pytestmark = pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="the shipped model is not in this checkout")

# every layout family the engine runs: AR, a context chain, linear and PRESTO trees under both
# schedules, PRESTO with context candidates (hybrid), and the planner
SETTINGS = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear one-pass": dict(mode="linear", schedule="one-pass", block_length=8),
    "presto two-pass": dict(mode="presto", schedule="two-pass", budget=8),
    "hybrid one-pass": dict(mode="presto", schedule="one-pass", budget=16, lookup=True),
    "auto": dict(plan="auto"),
}


@pytest.fixture(scope="module")
def shipped():
    return selfspec.load(SHIPPED)


@pytest.fixture(scope="module")
def prompts():
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        return [json.loads(line)["prompt"] for line in f][:6]


def _jobs(prompts):
    # greedy everywhere, plus sampled fixed layouts (their samples depend only on the seed);
    # `auto` stays greedy: its layouts depend on timing, so only its greedy tokens are reproducible
    jobs = [(p, name, 0.0) for p in prompts for name in SETTINGS]
    jobs += [(p, name, 1.0) for p in prompts[:3] for name in SETTINGS if name != "auto"]
    return jobs


def _run(model, tok, job, n=16):
    prompt, name, temperature = job
    return selfspec.generate(model, tok, prompt, max_new_tokens=n, temperature=temperature, seed=11,
                             eos_token_id=[], **SETTINGS[name]).token_ids


def test_threads_sharing_one_model_get_their_sequential_outputs(shipped, prompts):
    model, tok = shipped
    jobs = _jobs(prompts)
    want = {job: _run(model, tok, job) for job in jobs}
    for repeat in range(2):
        order = jobs[:]
        random.Random(repeat).shuffle(order)
        with ThreadPoolExecutor(max_workers=12) as pool:
            got = dict(zip(order, pool.map(lambda j: _run(model, tok, j), order)))
        wrong = [job for job in jobs if got[job] != want[job]]
        assert not wrong, f"repeat {repeat}: {len(wrong)}/{len(jobs)} threaded outputs differ, e.g. {wrong[:3]}"


def test_threads_with_the_draft_lora_get_their_sequential_outputs():
    m = tiny_model(vocab_size=261)
    g = torch.Generator().manual_seed(0)
    m.draft_lora = DraftLoRA(m, {i: (torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g))
                                 for i in range(2)}, scale=0.5)
    ids = [[5 + i, 40 + 3 * i, 7, 90 + i] for i in range(8)]

    cfg = selfspec.DecodeConfig(max_new_tokens=20, mode="presto", schedule="one-pass", budget=8, temperature=1.0)

    def run(i):
        return selfspec.generate_ids(m, ids[i], cfg, eos_token_id=[], generator=torch.Generator().manual_seed(i))[0]

    want = [run(i) for i in range(8)]
    for _ in range(2):
        with ThreadPoolExecutor(max_workers=8) as pool:
            assert list(pool.map(run, range(8))) == want


def test_generate_follows_model_to_another_dtype_and_back(shipped, prompts):
    model, tok = shipped
    kw = dict(max_new_tokens=16, mode="presto", schedule="one-pass", budget=8, eos_token_id=[])
    before = selfspec.generate(model, tok, prompts[0], **kw).token_ids
    bf16, _ = selfspec.load(SHIPPED, dtype=torch.bfloat16)
    want_bf16 = selfspec.generate(bf16, tok, prompts[0], **kw).token_ids
    try:
        model.to(torch.bfloat16)
        assert selfspec.generate(model, tok, prompts[0], **kw).token_ids == want_bf16
    finally:
        model.to(torch.float32)
    assert selfspec.generate(model, tok, prompts[0], **kw).token_ids == before


def test_draft_lora_follows_model_to_another_dtype():
    m = tiny_model(vocab_size=261)
    g = torch.Generator().manual_seed(0)
    m.draft_lora = DraftLoRA(m, {i: (torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g))
                                 for i in range(2)}, scale=0.5)
    cfg = selfspec.DecodeConfig(max_new_tokens=12, mode="presto", schedule="one-pass", budget=8)
    selfspec.generate_ids(m, [5, 6, 7], cfg, eos_token_id=[])
    m.to(torch.bfloat16)
    assert len(selfspec.generate_ids(m, [5, 6, 7], cfg, eos_token_id=[])[0]) == 12

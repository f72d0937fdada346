"""Ctrl-C: in Python the KeyboardInterrupt propagates and the model stays usable (the next
generation is identical to a fresh one); the CLI stops at once, keeps what it streamed, ends the
line and exits 130 (with --json: a record whose finish_reason is "interrupted")."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import selfspec
from selfspec.tools.cli import main
from selfspec.checkpoint.lora import DraftLoRA

from conftest import SHIPPED, tiny_model
from test_streaming import TOK

# explicit settings: the tests must not depend on the library's defaults
SETTINGS = {
    "presto one-pass": dict(mode="presto", schedule="one-pass", block_length=4, group_size=4, group_nodes=None,
                            budget=6, tree_top_k=2, lam=0.2, rho="ngram"),
    "linear two-pass": dict(mode="linear", schedule="two-pass", block_length=4),
}


class Interrupting:
    """Raises KeyboardInterrupt inside the n-th draft forward, between its layers (mid-forward:
    after layer 0's attention wrote its K/V, at its o_proj delta).

    It wraps the draft LoRA's per-module deltas (`add_deltas`, the float formats'; `add_fused`,
    the exact formats'), which the engine calls in every forward that has draft rows; `remove()`
    puts the originals back.
    """

    METHODS = ("add_deltas", "add_fused")

    def __init__(self, lora, n):
        self.lora, self.n, self.calls = lora, n, 0
        self.orig = {m: getattr(lora, m) for m in self.METHODS}
        for m in self.METHODS:
            setattr(lora, m, self._wrap(self.orig[m]))

    def _wrap(self, fn):
        def call(layer, names, *args):
            if layer == 0 and names == ("o_proj",):
                self.calls += 1
                if self.calls == self.n:
                    raise KeyboardInterrupt
            return fn(layer, names, *args)
        return call

    def remove(self):
        for m, fn in self.orig.items():
            setattr(self.lora, m, fn)


class InterruptingStreamer:
    """An HF-style streamer whose put() raises KeyboardInterrupt at its n-th call."""

    def __init__(self, n):
        self.n, self.calls, self.ended = n, 0, False

    def put(self, value):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt

    def end(self):
        self.ended = True


def _lora_model():
    """A tiny model with a draft LoRA attached, so an interrupt can land while the delta is on."""
    m = tiny_model(vocab_size=261)
    g = torch.Generator().manual_seed(0)
    weights = {i: (torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g)) for i in range(2)}
    m.draft_lora = DraftLoRA(m, weights, scale=0.5)
    return m


def _run(model, temperature, streamer=None, setting="presto one-pass"):
    return selfspec.generate(model, TOK, "def f(x):\n", max_new_tokens=24, temperature=temperature, top_p=0.9,
                             seed=7, eos_token_id=[], streamer=streamer, **SETTINGS[setting])


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("where", ["inside a draft forward", "in the streamer"])
def test_keyboard_interrupt_propagates_and_the_next_generation_equals_a_fresh_one(where, temperature, setting):
    model = _lora_model()
    run = lambda streamer=None: _run(model, temperature, streamer, setting)  # noqa: E731
    fresh = run()
    assert fresh.stats.rounds >= 3
    if where == "in the streamer":
        streamer = InterruptingStreamer(3)  # calls: the prompt, the prefill token, the first round
        with pytest.raises(KeyboardInterrupt):
            run(streamer)
        assert streamer.ended
    else:
        handle = Interrupting(model.draft_lora, 2)  # the 2nd draft forward: a round's, not the prefill's
        try:
            with pytest.raises(KeyboardInterrupt):
                run()
        finally:
            handle.remove()
    again = run()
    assert again.token_ids == fresh.token_ids and again.stats.accept_lengths == fresh.stats.accept_lengths


def test_an_interrupted_generation_reports_interrupted_and_keeps_the_committed_ids():
    model = _lora_model()
    full = _run(model, 0.0)
    gen = selfspec.stream(model, TOK, "def f(x):\n", max_new_tokens=24, eos_token_id=[], **SETTINGS["presto one-pass"])
    handle = Interrupting(model.draft_lora, 4)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in gen:
                pass
    finally:
        handle.remove()
    assert gen.finish_reason == "interrupted"
    assert 0 < len(gen.token_ids) < len(full.token_ids) and gen.token_ids == full.token_ids[: len(gen.token_ids)]


@pytest.fixture
def sigint_at_forward(monkeypatch):
    """Make the CLI's model send a real SIGINT to this process at its n-th output-head call."""
    import selfspec.loading
    from selfspec.engine.forward.forward import FastForward

    real_load = selfspec.loading.load

    def install(n):
        def load(*a, **k):
            model, tok = real_load(*a, **k)
            ff = FastForward.of(model)
            head, calls = ff.logits, [0]

            def logits(hidden):
                calls[0] += 1
                if calls[0] == n:
                    os.kill(os.getpid(), signal.SIGINT)
                return head(hidden)

            ff.logits = logits
            return model, tok

        monkeypatch.setattr(selfspec.loading, "load", load)

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return install


def _args(tiny_dir, *extra):
    s = SETTINGS["linear two-pass"]
    return ["generate", "--model", str(tiny_dir), "--prompt", "import os\n", "--max-new-tokens", "40", "--mode", s["mode"],
            "--schedule", s["schedule"], "--block-length", str(s["block_length"]), *extra]


def test_cli_json_record_on_sigint_says_interrupted_with_the_tokens_so_far(tiny_dir, sigint_at_forward, capsys):
    assert main(_args(tiny_dir, "--json")) == 0
    full = json.loads(capsys.readouterr().out)
    sigint_at_forward(5)
    assert main(_args(tiny_dir, "--json")) == 130
    cap = capsys.readouterr()
    rec = json.loads(cap.out)
    assert cap.err == "" and cap.out.count("\n") == 1
    assert rec["finish_reason"] == "interrupted"
    assert 0 < len(rec["token_ids"]) < len(full["token_ids"])
    assert rec["token_ids"] == full["token_ids"][: len(rec["token_ids"])]


def test_cli_text_on_sigint_keeps_the_streamed_text_and_prints_only_a_newline(tiny_dir, sigint_at_forward, capsys):
    assert main(_args(tiny_dir)) == 0
    full = capsys.readouterr().out
    sigint_at_forward(5)
    assert main(_args(tiny_dir)) == 130
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out.endswith("\n")
    assert full.startswith(cap.out[:-1]) and len(cap.out) < len(full)


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")), reason="no shipped model")
def test_sigint_to_a_streaming_cli_process_exits_130_with_the_streamed_prefix(default_model):
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    opts = ["--mode", "presto", "--schedule", "one-pass", "--block-length", "8", "--group-size", "8", "--budget", "16",
            "--tree-top-k", "4", "--lam", "0.2", "--rho", "ngram", "--temperature", "0", "--max-new-tokens", "3000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "selfspec", "generate", "--prompt", prompt, *opts],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = proc.stdout.read1(64)  # the first streamed text: generation is under way
        assert first, proc.stderr.read().decode()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        stopped_after = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (first + rest).decode()
    assert proc.returncode == 130, err.decode()
    assert err.decode() == "" and out.endswith("\n")
    assert stopped_after < 5  # at once, not after 3000 tokens
    model, tok = default_model
    full = selfspec.generate(model, tok, prompt, max_new_tokens=len(tok.encode(out)) + 16, mode="ar", eos_token_id=[])
    assert full.text.startswith(out[:-1]) and len(out) > 1


def test_cli_bench_on_sigint_exits_130_without_a_traceback(tiny_dir, sigint_at_forward, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    sigint_at_forward(3)
    rc = main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--modes", "ar", "linear",
               "--schedules", "two-pass", "--max-new-tokens", "8", "--block-length", "4", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 130 and cap.out == "\n" and "Traceback" not in cap.err
    assert not (tmp_path / "o" / "results.json").exists()  # nothing half-written

import os
import tempfile

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch a hub
# models load in fp32 unless a test names a format (the default, "auto", measures the formats once)
os.environ["SELFSPEC_WEIGHTS"] = "fp32"
# cost profiles measured by tests go to a throwaway folder, never the user's cache
os.environ.setdefault("SELFSPEC_CACHE", tempfile.mkdtemp(prefix="selfspec-test-cache-"))
# the default model is SmolLM2 (converted on first use); tests that do not name a model get the 9M one
os.environ["SELFSPEC_MODEL"] = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                                            "pystdlib-nld-9m")
torch.set_num_threads(min(2, torch.get_num_threads()))

from hypothesis import settings  # noqa: E402

# the same examples on every run: a CI failure is always reproducible locally
settings.register_profile("selfspec", derandomize=True, database=None)
settings.load_profile("selfspec")

from selfspec.checkpoint.config import NemotronLabsDiffusionConfig  # noqa: E402
from selfspec.checkpoint.model import NemotronLabsDiffusionModel  # noqa: E402


def tiny_config(**overrides) -> NemotronLabsDiffusionConfig:
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 32.0,  # = max_position_embeddings / original max (no YaRN warning)
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        mask_token_id=4,
        block_size=8,
        tie_word_embeddings=False,
        architectures=["NemotronLabsDiffusionModel"],
    )
    kw.update(overrides)
    return NemotronLabsDiffusionConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> NemotronLabsDiffusionModel:
    torch.manual_seed(seed)
    model = NemotronLabsDiffusionModel(tiny_config(**overrides))
    # Sharpen the random weights so argmaxes are well separated (no float near-ties).
    with torch.no_grad():
        model.diffusion_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only adds synchronisation (and loses badly on a busy machine).
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def model():
    return tiny_model()


SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "pystdlib-nld-9m")


@pytest.fixture(scope="session")
def _default_loaded():
    import selfspec

    return selfspec.load()


@pytest.fixture(scope="module")
def default_model(_default_loaded):
    """`(model, tokenizer)` of the default model (`selfspec.load()`), loaded once per test run.
    Each module starts it with no planner learnt by another module's generations; a test that
    changes its weights or cache loads a model of its own."""
    model, tok = _default_loaded
    model.__dict__.pop("_selfspec_planners", None)
    return model, tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A checkpoint directory: a tiny random model with the shipped tokenizer's vocabulary."""
    from selfspec.checkpoint.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(os.path.join(SHIPPED, "tokenizer.model"))
    path = tmp_path_factory.mktemp("tiny_ckpt")
    tiny_model(vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(str(path))
    return path


class OneRow:
    """One cache row of the runtime's forward: tokens [q] at cache length + offsets [q]."""

    def __init__(self, model):
        from selfspec.engine.forward.batch_forward import BatchForward
        from selfspec.engine.forward.forward import FastForward

        self.bf = BatchForward(FastForward(model))
        self.ff = self.bf.ff

    def new_cache(self, capacity):
        return self.bf.new_cache(1, capacity)

    def __call__(self, tokens, offsets, cache, *, block=None, **kw):
        return self.bf(tokens[None], offsets[None], cache, slice(0, 1), block=None if block is None else block[None],
                       **kw)[0]

    def logits(self, hidden):
        return self.bf.logits(hidden)


class FakeClock:
    """A clock that moves only when told (`t += seconds`): what the planner and the decoder read
    as time in tests that price forwards themselves."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class PricedForward:
    """The real batched forward; each call moves a fake clock by `cost(rows, width, cached)` (the
    cost model's price, or a truth the cost model does not know). `prefills` keeps the price of
    every prompt chunk: a causal (prefill) call's, or what a chunk riding in a round's forward
    (`join=`) adds to it, cost(1, R q + its tokens, its cached) - cost(1, R q, its cached)."""

    def __init__(self, bf, clock: FakeClock, cost):
        self.bf, self.clock, self.cost, self.prefills = bf, clock, cost, []

    def __call__(self, tokens, offsets, cache, rows, **kw):
        R, q = tokens.shape
        dt = self.cost(R, q, cache.lengths[rows.start])
        join = kw.get("join")
        if join is not None:
            k, c = join.tokens.shape
            cached = cache.lengths[join.rows.start]
            extra = self.cost(1, R * q + k * c, cached) - self.cost(1, R * q, cached)
            self.prefills.append(extra)
            dt += extra
        self.clock.t += dt
        if kw.get("causal"):
            self.prefills.append(dt)
        return self.bf(tokens, offsets, cache, rows, **kw)

    def __getattr__(self, name):
        return getattr(self.bf, name)


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory):
    """kernel_build(name, march): `name`.c built for -march once a test run (`kernel_builds.py`)."""
    from kernel_builds import KernelBuilds

    return KernelBuilds(str(tmp_path_factory.mktemp("kernel-builds")))

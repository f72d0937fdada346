"""selfspec: self-speculative decoding (AR, linear, PRESTO tree) with diffusion language models.

    import selfspec
    model, tok = selfspec.load()                      # the shipped model
    for delta in selfspec.stream(model, tok, "def add(a, b):\\n", max_new_tokens=32):
        print(delta, end="")
"""

from .versions import check_transformers

check_transformers()  # before anything builds on transformers: one clear error naming the range

from .config import DecodeConfig, NemotronLabsDiffusionConfig  # noqa: E402
from .model import NemotronLabsDiffusionModel, default_model_dir, load, register  # noqa: E402
from .runtime import Decoder, Stats, generate_ids  # noqa: E402
from .streaming import Generation, generate, stream  # noqa: E402

register()

__all__ = [
    "DecodeConfig",
    "Decoder",
    "Generation",
    "NemotronLabsDiffusionConfig",
    "NemotronLabsDiffusionModel",
    "Stats",
    "default_model_dir",
    "generate",
    "generate_ids",
    "load",
    "stream",
]
__version__ = "0.1.0"

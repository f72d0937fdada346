"""selfspec: self-speculative decoding (AR, linear, PRESTO tree) with diffusion language models.

    import selfspec
    model, tok = selfspec.load()                      # the shipped model
    for delta in selfspec.stream(model, tok, "def add(a, b):\\n", max_new_tokens=32):
        print(delta, end="")
"""

from selfspec.checkpoint.versions import check_transformers

check_transformers()  # before anything builds on transformers: one clear error naming the range

from selfspec.checkpoint.config import NemotronLabsDiffusionConfig  # noqa: E402
from selfspec.checkpoint.model import NemotronLabsDiffusionModel, default_model_dir, register  # noqa: E402
from selfspec.compat import ar_generate, attach, linear_spec_generate, presto_spec_generate  # noqa: E402
from selfspec.engine.schedule.decoder import Decoder, generate_ids  # noqa: E402
from selfspec.engine.request.options import DecodeConfig  # noqa: E402
from selfspec.engine.request.stats import Stats  # noqa: E402
from selfspec.loading import load  # noqa: E402
from selfspec.streaming import Generation, generate, stream  # noqa: E402

register()
attach(NemotronLabsDiffusionModel)

__all__ = [
    "DecodeConfig",
    "Decoder",
    "Generation",
    "NemotronLabsDiffusionConfig",
    "NemotronLabsDiffusionModel",
    "Stats",
    "ar_generate",
    "linear_spec_generate",
    "presto_spec_generate",
    "default_model_dir",
    "generate",
    "generate_ids",
    "load",
    "stream",
]
__version__ = "0.1.0"

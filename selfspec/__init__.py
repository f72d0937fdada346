"""selfspec: self-speculative decoding (AR, linear, PRESTO tree) with diffusion language models."""

from .config import DecodeConfig, NemotronLabsDiffusionConfig
from .model import NemotronLabsDiffusionModel, register

register()

__all__ = ["DecodeConfig", "NemotronLabsDiffusionConfig", "NemotronLabsDiffusionModel"]
__version__ = "0.1.0"

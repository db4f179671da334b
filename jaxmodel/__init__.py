"""The qwen35 model in JAX, loaded from GGUF: pure functions over a weights pytree and state pools."""

from .config import ModelConfig, ModelFormatError
from .model import Model, forward, load_model, mtp_forward
from .state import ModelState, StepBatch, StepOutput

__all__ = [
    "Model", "ModelConfig", "ModelFormatError", "ModelState", "StepBatch", "StepOutput",
    "forward", "load_model", "mtp_forward",
]  # fmt: skip

"""The qwen35 model in JAX, loaded from GGUF: pure functions over a weights pytree and state pools."""

from .xla_flags import set_batch_invariant_flags, warn_if_started

if set_batch_invariant_flags():  # before any JAX backend starts
    warn_if_started()

from .config import ModelConfig, ModelFormatError
from .model import Model, forward, load_model, mtp_forward
from .state import ModelState, StepBatch, StepOutput

__all__ = [
    "Model", "ModelConfig", "ModelFormatError", "ModelState", "StepBatch", "StepOutput",
    "forward", "load_model", "mtp_forward",
]  # fmt: skip

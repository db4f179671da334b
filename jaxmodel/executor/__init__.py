"""The device executor: a model's state pools, the few shapes it compiles, the one-call step and its inputs, what
its steps cost, and the host's I/O with the device. The model itself (`jaxmodel.model`, its layers and kernels)
knows nothing of it."""

from .costs import Calibration, StepCosts, calibrate, plane_write_cost
from .rows import Iteration, RowLoop, RowResult, StepRow
from .runtime import Runtime
from .shapes import Shapes, share_buckets

__all__ = ["Calibration", "Iteration", "RowLoop", "RowResult", "Runtime", "Shapes", "StepCosts", "StepRow",
           "calibrate", "plane_write_cost", "share_buckets"]

"""The one rule for what of a tensor goes to the host as numpy: numpy has no bfloat16, so it is widened to
float32 (exactly). Used by every copy of tensors into files or shared memory; no torch import needed."""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_storable(value: Any) -> Any:
    """A tensor detached, bfloat16 widened to float32, still on its device; anything else as a numpy array."""
    if hasattr(value, "detach"):  # a torch.Tensor
        value = value.detach()
        return value.float() if str(value.dtype) == "torch.bfloat16" else value
    return np.asarray(value)

"""rolloutcli: recorded RL rollouts (HDF5, ``[T, N, ...]``) to training data, matching RSL-RL.

Public names are imported lazily so that ``import rolloutcli`` (and ``rolloutcli --help``) does not
import torch or h5py.
"""

from __future__ import annotations

import importlib
from typing import Any

from rolloutcli.errors import RolloutError

__version__ = "0.1.0"

_LAZY = {
    "compute_gae": "rolloutcli.core.gae",
    "normalize_advantages": "rolloutcli.core.gae",
    "bootstrap_time_outs": "rolloutcli.core.gae",
    "hidden_states_at_starts": "rolloutcli.core.trajectories",
    "split_and_pad_trajectories": "rolloutcli.core.trajectories",
    "unpad_trajectories": "rolloutcli.core.trajectories",
    "trajectory_spans": "rolloutcli.core.trajectories",
    "CircularBuffer": "rolloutcli.core.circular_buffer",
    "RolloutStorage": "rolloutcli.storage",
    "ShardDataset": "rolloutcli.shards",
    "Batch": "rolloutcli.minibatch",
    "ShardStorage": "rolloutcli.rsl_train",
    "update_from_shards": "rolloutcli.rsl_train",
    "RolloutDataset": "rolloutcli.rollout_dataset",
    "TrajectoryDataset": "rolloutcli.rollout_dataset",
}

__all__ = ["RolloutError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rolloutcli' has no attribute {name!r}")

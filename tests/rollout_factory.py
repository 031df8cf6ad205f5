"""Build rollout files for tests with plain h5py (independent of rolloutcli's own writer).

Values are identifiable: observation ``[t, n, k] = t * 1000 + n + k / 100`` so any row can be traced back
to its step and env.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np


def identifiable(T: int, N: int, dim: int, dtype: Any = np.float32) -> np.ndarray:
    """``[T, N, dim]`` with value ``t * 1000 + n + k / 100``."""
    t = np.arange(T)[:, None, None] * 1000.0
    n = np.arange(N)[None, :, None]
    k = np.arange(dim)[None, None, :] / 100.0
    return (t + n + k).astype(dtype)


def rollout_arrays(
    T: int = 12,
    N: int = 3,
    *,
    seed: int = 0,
    end_rate: float = 0.2,
    obs_dim: int = 4,
    critic_dim: int = 5,
    action_dim: int = 2,
    hidden: str | None = "gru",
    layers: int = 1,
    hidden_size: int = 3,
    time_out_rate: float = 0.5,
) -> dict[str, np.ndarray]:
    """A complete, valid rollout as numpy arrays keyed by dataset path."""
    rng = np.random.default_rng(seed)
    dones = (rng.random((T, N)) < end_rate).astype(np.uint8)
    time_outs = (dones.astype(bool) & (rng.random((T, N)) < time_out_rate)).astype(np.uint8)
    arrays: dict[str, np.ndarray] = {
        "observations/policy": identifiable(T, N, obs_dim),
        "observations/critic": identifiable(T, N, critic_dim) + 0.5,
        "actions": rng.standard_normal((T, N, action_dim)).astype(np.float32),
        "rewards": rng.standard_normal((T, N)).astype(np.float32),
        "dones": dones,
        "time_outs": time_outs,
        "values": rng.standard_normal((T, N)).astype(np.float32),
        "last_values": rng.standard_normal(N).astype(np.float32),
        "actions_log_prob": rng.standard_normal((T, N)).astype(np.float32),
        "distribution/mean": rng.standard_normal((T, N, action_dim)).astype(np.float32),
        "distribution/std": rng.random((T, N, action_dim)).astype(np.float32) + 0.1,
    }
    if hidden is not None:
        count = 2 if hidden == "lstm" else 1
        for net in ("actor", "critic"):
            for i in range(count):
                state = rng.standard_normal((T, layers, N, hidden_size)).astype(np.float32)
                arrays[f"hidden_states/{net}/{i}"] = state
    return arrays


def write_rollout(
    path: Path, arrays: dict[str, np.ndarray], attrs: dict[str, Any] | None = None, **dataset_options: Any
) -> Path:
    """Write ``arrays`` to ``path`` as a rollout file with plain h5py."""
    with h5py.File(path, "w") as handle:
        handle.attrs["rolloutcli_format"] = "rollout"
        handle.attrs["format_version"] = 1
        for key, value in (attrs or {}).items():
            handle.attrs[key] = value
        for name, value in arrays.items():
            handle.create_dataset(name, data=value, **dataset_options)
    return path


def make_rollout(path: Path, **kwargs: Any) -> Path:
    """Write a valid rollout (see ``rollout_arrays`` for options) and return its path."""
    attrs = kwargs.pop("attrs", None)
    options = kwargs.pop("dataset_options", {})
    return write_rollout(path, rollout_arrays(**kwargs), attrs, **options)


def shard_folders(name: str, arrays: dict[str, np.ndarray], modes: dict[str, Any]) -> Any:
    """A module-scoped pytest fixture: ``arrays`` written as a rollout, exported by ``run_batch`` once per
    ``mode: BatchOptions`` into a folder of that name; the fixture gives ``{mode: folder}``."""
    import pytest

    @pytest.fixture(scope="module")
    def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        from rolloutcli.pipeline.batch import run_batch
        from rolloutcli.pipeline.options import RunOptions

        root = tmp_path_factory.mktemp(name)
        src = write_rollout(root / "src.h5", arrays)
        for mode, options in modes.items():
            run_batch(src, root / mode, options, RunOptions())
        return {mode: root / mode for mode in modes}

    return folders

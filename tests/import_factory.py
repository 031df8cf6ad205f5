"""Foreign recordings for the ``import`` tests, built with plain h5py (and minari's DataCollector).

Values are identifiable: observation row ``s`` of the whole recording holds ``s * 10 + k / 100`` (k the
feature), so any imported row can be traced to its source step.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np


def obs_rows(first: int, count: int, dim: int = 3) -> np.ndarray:
    return (np.arange(first, first + count)[:, None] * 10.0 + np.arange(dim)[None] / 100).astype(np.float32)


def make_d4rl(
    path: Path, lengths: list[int], *, timeout_at: tuple[int, ...] = (), next_obs: bool = True, cut_last: bool = False
) -> Path:
    """Episodes of ``lengths`` steps, flat; episode i ends by a time-out when i is in ``timeout_at``."""
    T = sum(lengths)
    terminals, timeouts = np.zeros(T, bool), np.zeros(T, bool)
    ends = np.cumsum(lengths) - 1
    for i, end in enumerate(ends):
        if cut_last and i == len(lengths) - 1:
            continue
        (timeouts if i in timeout_at else terminals)[end] = True
    with h5py.File(path, "w") as f:
        f["observations"] = obs_rows(0, T)
        f["actions"] = np.arange(T * 2, dtype=np.float32).reshape(T, 2)
        f["rewards"] = np.arange(T, dtype=np.float32)
        f["terminals"], f["timeouts"] = terminals, timeouts
        if next_obs:
            f["next_observations"] = obs_rows(0, T) + 5
        f["infos/qpos"] = np.arange(T * 2, dtype=np.float64).reshape(T, 2)
        f["metadata/algorithm"] = np.bytes_(b"SAC")
    return path


def make_robomimic(path: Path, lengths: list[int], *, next_obs: bool = True, rewards: bool = True) -> Path:
    """``data/demo_k`` with obs/{pos, img}, actions, rewards, dones (1 at the end of even demos), states."""
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["env_args"] = '{"env_name": "Lift"}'
        first = 0
        for k, L in enumerate(lengths):
            demo = data.create_group(f"demo_{k}")
            demo["obs/pos"] = obs_rows(first, L)
            demo["obs/img"] = np.full((L, 2, 2), k % 256, np.uint8)
            if next_obs:
                demo["next_obs/pos"] = obs_rows(first, L) + 5
                demo["next_obs/img"] = np.full((L, 2, 2), (k + 100) % 256, np.uint8)
            demo["actions"] = np.full((L, 2), k, np.float32)
            if rewards:
                demo["rewards"] = np.arange(first, first + L, dtype=np.float64)
            dones = np.zeros(L, np.int64)
            dones[-1] = k % 2 == 0
            demo["dones"] = dones
            demo["states"] = np.full((L, 4), first, np.float64)
            demo["initial_state/joint"] = np.full((1, 3), k, np.float32)
            demo.attrs["num_samples"] = L
            first += L
        f["mask/train"] = np.array([f"demo_{k}".encode() for k in range(len(lengths))])
    return path


def make_ikostrikov(T: int, N: int, H: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """An ikostrikov RolloutStorage's tensors after T inserts (masks, bad_masks with T+1 rows)."""
    rng = np.random.default_rng(seed)
    masks = np.ones((T + 1, N, 1), np.float32)
    masks[1:] = (rng.random((T, N, 1)) > 0.3).astype(np.float32)
    bad = np.ones((T + 1, N, 1), np.float32)
    bad[1:] = np.where((masks[1:] == 0) & (rng.random((T, N, 1)) > 0.5), 0.0, 1.0)
    return {
        "obs": rng.standard_normal((T + 1, N, 4)).astype(np.float32),
        "recurrent_hidden_states": rng.standard_normal((T + 1, N, H)).astype(np.float32),
        "rewards": rng.standard_normal((T, N, 1)).astype(np.float32),
        "value_preds": rng.standard_normal((T + 1, N, 1)).astype(np.float32),
        "returns": np.zeros((T + 1, N, 1), np.float32),
        "action_log_probs": rng.standard_normal((T, N, 1)).astype(np.float32),
        "actions": rng.integers(0, 3, (T, N, 1)),
        "masks": masks,
        "bad_masks": bad,
    }


def write_arrays(path: Path, arrays: dict[str, Any]) -> Path:
    with h5py.File(path, "w") as f:
        for name, value in arrays.items():
            f[name] = value
    return path


@contextlib.contextmanager
def _fake_jax() -> Iterator[None]:
    """minari's DataCollector maps its step data with ``jax.tree_util.tree_map`` (jax is not installed here),
    importing it at each step: the same mapping over dicts and tuples, the first tree giving the structure, in
    ``sys.modules`` only while the dataset is made. (Left there, it broke torchrl's first import in a later test:
    ``importlib.util.find_spec("jax")`` raises on a module without a spec.)"""

    def tree_map(fn: Any, tree: Any, *rest: Any) -> Any:
        if isinstance(tree, dict):
            return {k: tree_map(fn, tree[k], *[r[k] for r in rest]) for k in tree}
        if isinstance(tree, tuple):
            return tuple(tree_map(fn, t, *[r[i] for r in rest]) for i, t in enumerate(tree))
        return fn(tree, *rest)

    jax, util = types.ModuleType("jax"), types.ModuleType("jax.tree_util")
    util.tree_map = tree_map  # type: ignore[attr-defined]
    jax.tree_util = util  # type: ignore[attr-defined]
    added = {name: module for name, module in (("jax", jax), ("jax.tree_util", util)) if name not in sys.modules}
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def make_minari(root: Path, episodes: int, *, dict_obs: bool = False, max_steps: int = 7) -> tuple[Path, Any]:
    """A local Minari dataset collected with DataCollector around CartPole (time limit ``max_steps``); returns
    (its folder, the MinariDataset)."""
    import os
    import warnings

    os.environ["MINARI_DATASETS_PATH"] = str(root)
    import gymnasium as gym
    from minari import DataCollector

    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    if dict_obs:
        env = gym.wrappers.TransformObservation(
            env,
            lambda o: {"pos": o[:2], "vel": {"v": o[2:]}},
            gym.spaces.Dict(
                {
                    "pos": gym.spaces.Box(-5, 5, (2,)),
                    "vel": gym.spaces.Dict({"v": gym.spaces.Box(-np.inf, np.inf, (2,))}),
                }
            ),
        )
    name = "test/cart-dict-v0" if dict_obs else "test/cart-v0"
    with _fake_jax():
        env = DataCollector(env, record_infos=False)
        env.action_space.seed(0)
        for seed in range(episodes):
            env.reset(seed=seed)
            while True:
                *_, terminated, truncated, _ = env.step(env.action_space.sample())
                if terminated or truncated:
                    break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # minari's advice on metadata (author, description, eval_env)
            dataset = env.create_dataset(dataset_id=name, algorithm_name="random")
    return root / name, dataset

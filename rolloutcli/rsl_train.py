"""Train RSL-RL's own ``PPO`` or ``Distillation`` from a ``rolloutcli batch`` folder: :func:`update_from_shards`.

RSL-RL 5.x's ``update()`` takes no batch: it reads its storage's generators (``mini_batch_generator``,
``recurrent_mini_batch_generator``, ``generator``), then ``storage.observations`` (its normalizers' update) and
``storage.clear()``. :class:`ShardStorage` answers those calls from a shard folder; :func:`update_from_shards`
puts one in place of the algorithm's storage for one ``update()``. With ``batch --rsl-parity -m M --epochs E``
(M, E: the algorithm's ``num_mini_batches``, ``num_learning_epochs``) and the seed RSL-RL's ``torch.randperm``
would have drawn, the update is RSL-RL's bit for bit (feed-forward, recurrent; distillation needs no option).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.shards import MANIFEST_NAME
from rolloutcli.shards import ShardDataset

_GENERATOR_MODE = {
    "mini_batch_generator": "feedforward",
    "recurrent_mini_batch_generator": "recurrent",
    "generator": "distillation",
}
_MODE_OPTION = {"feedforward": "", "recurrent": " --recurrent", "distillation": " --distillation"}


class ShardStorage:
    """What RSL-RL's ``PPO.update()`` / ``Distillation.update()`` read from their storage, from a shard folder.

    The generators yield the folder's shards in manifest order (every written epoch, as one ``update()``
    consumes them; distillation: the first written epoch's steps at each call). ``observations`` are the rows the
    shards hold, read once: ``[T, N]`` as RSL-RL's storage holds them when no row was dropped (``batch`` drops
    ``T*N % M`` rows, or ``N % M`` envs, with ``--rsl-parity``), else ``[1, rows]`` in source order.
    """

    def __init__(
        self, folder: str | Path, *, device: str | torch.device = "cpu", verify_checksums: bool = False
    ) -> None:
        self.dataset = ShardDataset(folder, device=device, epochs="all", verify_checksums=verify_checksums)
        manifest = self.dataset.manifest
        self.mode: str = manifest["mode"]
        self.num_transitions_per_env = int(manifest["source"]["T"])
        self.num_envs = int(manifest["source"]["N"])
        self.training_type = "distillation" if self.mode == "distillation" else "rl"
        self.device = device
        epochs = [entry["epoch"] for entry in manifest["shards"]]
        self.num_epochs = len(set(epochs))
        self.num_mini_batches = epochs.count(epochs[0])
        self._observations: Any = None

    # ------------------------------------------------------------------------------------- RSL-RL's generators
    def mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8) -> Any:
        """The feed-forward shards, every epoch (RSL-RL's arguments are checked against the folder's)."""
        self._check("mini_batch_generator", num_mini_batches, num_epochs)
        return iter(self.dataset)

    def recurrent_mini_batch_generator(self, num_mini_batches: int, num_epochs: int = 8) -> Any:
        """The recurrent shards, every epoch (RSL-RL's arguments are checked against the folder's)."""
        self._check("recurrent_mini_batch_generator", num_mini_batches, num_epochs)
        return iter(self.dataset)

    def generator(self) -> Any:
        """The distillation steps of the first written epoch, in time order (called once per learning epoch)."""
        self._check("generator", None, None)
        first = self.dataset.manifest["shards"][0]["epoch"]
        return iter(ShardDataset(self.dataset.folder, device=self.device, epochs=[first]))

    def clear(self) -> None:
        """Nothing to reset: the shards are read again at the next ``update()``."""

    def _check(self, generator: str, num_mini_batches: int | None, num_epochs: int | None) -> None:
        """Refuse a folder whose mode, mini-batches or epochs are not what the algorithm asks for."""
        path = self.dataset.folder / MANIFEST_NAME
        wanted = _GENERATOR_MODE[generator]
        if self.mode != wanted:
            raise RolloutError.field(
                path, "mode", f"{wanted} (the algorithm calls {generator})", self.mode,
                f"Write the shards with `rolloutcli batch{_MODE_OPTION[wanted]}`.",
            )  # fmt: skip
        asked = {"num_mini_batches": (num_mini_batches, self.num_mini_batches), "epochs": (num_epochs, self.num_epochs)}
        for name, (theirs, ours) in asked.items():
            if theirs is not None and theirs != ours:
                option = "-m" if name == "num_mini_batches" else "--epochs"
                what = "num_mini_batches" if name == "num_mini_batches" else "num_learning_epochs"
                raise RolloutError.field(
                    path, name, f"{theirs} (the algorithm's {what})", str(ours),
                    f"Write the shards with `rolloutcli batch {option} {theirs}` or set {what}={ours}.",
                )  # fmt: skip

    # ------------------------------------------------------------------------------------------ observations
    @property
    def observations(self) -> Any:
        """The rows the shards hold (what the algorithm's normalizers update on), read at first use."""
        if self._observations is None:
            self._observations = self._read_observations()
        return self._observations

    def _read_observations(self) -> Any:
        from tensordict import TensorDict

        T, N = self.num_transitions_per_env, self.num_envs
        first = self.dataset.manifest["shards"][0]["epoch"]
        shards = ShardDataset(self.dataset.folder, device=self.device, epochs=[first], as_dict=True)
        parts: dict[str, list[torch.Tensor]] = {}
        rows: list[torch.Tensor] = []
        for item in shards:
            index, values = _rows_of(self.mode, item, N)
            rows.append(index)
            for name, value in values.items():
                parts.setdefault(name, []).append(value)
        order = torch.argsort(torch.cat(rows))
        held = int(order.numel())
        shape = [T, N] if held == T * N else [1, held]
        data = {name: torch.cat(values)[order].reshape(*shape, *values[0].shape[1:]) for name, values in parts.items()}
        return TensorDict(data, batch_size=shape, device=self.device)


def _rows_of(mode: str, item: dict[str, Any], N: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One shard's source rows (``t * N + env``) and observations ``{key: [rows, ...]}`` in that order."""
    observations = {k.removeprefix("observations/"): v for k, v in item.items() if k.startswith("observations/")}
    if mode == "feedforward":
        return item["index"].to(torch.int64), observations
    if mode == "distillation":  # [steps, N, ...]
        steps = item["steps"].to(torch.int64)
        index = (steps[:, None] * N + torch.arange(N, device=steps.device)).reshape(-1)
        return index, {k: v.flatten(0, 1) for k, v in observations.items()}
    # recurrent: padded trajectories [L, M, ...] of the shard's envs, env by env; masks mark the real steps
    masks, envs = item["masks"].bool(), item["env_ids"].to(torch.int64)
    steps = item["actions"].shape[0]
    valid = {k: v.transpose(0, 1)[masks.transpose(0, 1)] for k, v in observations.items()}  # [envs * T] env-major
    index = (torch.arange(steps, device=envs.device)[None, :] * N + envs[:, None]).reshape(-1)
    return index, valid


def update_from_shards(algorithm: Any, folder: str | Path, *, verify_checksums: bool = False) -> dict[str, float]:
    """One ``algorithm.update()`` of RSL-RL's ``PPO`` or ``Distillation`` on a shard folder; its loss dict.

    The algorithm's own storage is put back afterwards (and is not cleared). Raises ``RolloutError`` when the
    folder's mode, mini-batches per epoch or epochs differ from what the algorithm asks for.
    """
    storage = ShardStorage(folder, device=getattr(algorithm, "device", "cpu"), verify_checksums=verify_checksums)
    own = algorithm.storage
    algorithm.storage = storage
    try:
        return algorithm.update()
    finally:
        algorithm.storage = own

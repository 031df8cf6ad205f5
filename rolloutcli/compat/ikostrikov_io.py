"""``IkostrikovRolloutStorage`` to and from a rollout file (mapping in :mod:`rolloutcli.compat.ikostrikov`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.storage_io import write_rollout

if TYPE_CHECKING:
    from rolloutcli.compat.ikostrikov import IkostrikovRolloutStorage

_EXTRAS = ("ikostrikov_first_masks", "ikostrikov_first_bad_masks", "ikostrikov_last_hidden")


def write_storage(storage: IkostrikovRolloutStorage, path: Path, *, overwrite: bool = False) -> None:
    steps = storage.rewards.size(0)
    hidden = storage.recurrent_hidden_states
    tensors: dict[str, Any] = {
        "observations/policy": storage.obs[:steps],
        "last_observations/policy": storage.obs[steps],
        "actions": storage.actions,
        "rewards": storage.rewards[..., 0],
        "dones": (1 - storage.masks[1:, :, 0]).to(torch.uint8),
        "time_outs": (1 - storage.bad_masks[1:, :, 0]).to(torch.uint8),
        "values": storage.value_preds[:steps, :, 0],
        "last_values": storage.value_preds[steps, :, 0],
        "actions_log_prob": storage.action_log_probs[..., 0],
        "hidden_states/actor/0": hidden[:steps].unsqueeze(1),
        "ikostrikov_first_masks": storage.masks[0, :, 0],
        "ikostrikov_first_bad_masks": storage.bad_masks[0, :, 0],
        "ikostrikov_last_hidden": hidden[steps],
    }
    write_rollout(path, tensors, {"recorded_with": "IkostrikovRolloutStorage"}, overwrite=overwrite)


def _observation_key(reader: RolloutReader) -> str:
    keys = reader.schema.observation_keys
    if len(keys) != 1:
        raise RolloutError.field(
            reader.path,
            "observations",
            "one observation group (the storage holds one obs tensor)",
            f"{len(keys)} groups: {', '.join(keys)}",
            "Write a file with one group, e.g. observations/policy.",
        )
    return next(iter(keys.values()))


def read_storage(cls: type[IkostrikovRolloutStorage], path: Path) -> IkostrikovRolloutStorage:
    with RolloutReader(path, SafetyOptions()) as reader:
        fields, steps, envs = reader.schema.fields, reader.T, reader.N

        def get(name: str) -> torch.Tensor:
            return reader.tensor(name)

        def column(name: str, default: float) -> torch.Tensor:
            if name not in fields:
                return torch.full((envs, 1), default)
            return get(name).float().reshape(envs, 1)

        storage = cls.__new__(cls)
        obs = get(_observation_key(reader)).float()
        last = "last_observations/policy"
        last_obs = get(last).float() if last in fields else torch.zeros_like(obs[0])
        storage.obs = torch.cat([obs, last_obs.unsqueeze(0)])
        hidden = get("hidden_states/actor/0")[:, 0].float() if "hidden_states/actor/0" in fields else None
        if hidden is None:
            hidden = torch.zeros(steps, envs, 1)
        last_hidden = get(_EXTRAS[2]).float() if _EXTRAS[2] in fields else torch.zeros_like(hidden[0])
        storage.recurrent_hidden_states = torch.cat([hidden, last_hidden.unsqueeze(0)])
        storage.rewards = get("rewards").float().reshape(steps, envs, 1)
        values = get("values").float().reshape(steps, envs, 1) if "values" in fields else torch.zeros(steps, envs, 1)
        storage.value_preds = torch.cat([values, column("last_values", 0.0).unsqueeze(0)])
        storage.returns = torch.zeros(steps + 1, envs, 1)
        log_prob = "actions_log_prob"
        storage.action_log_probs = (
            get(log_prob).float().reshape(steps, envs, 1) if log_prob in fields else torch.zeros(steps, envs, 1)
        )
        actions = get("actions")
        storage.actions = actions.long() if not actions.is_floating_point() else actions.float()
        if storage.actions.dim() == 2:
            storage.actions = storage.actions.unsqueeze(-1)
        dones = get("dones").float().reshape(steps, envs, 1)
        time_outs = get("time_outs").float().reshape(steps, envs, 1) if "time_outs" in fields else dones * 0
        storage.masks = torch.cat([column(_EXTRAS[0], 1.0).unsqueeze(0), 1 - dones])
        storage.bad_masks = torch.cat([column(_EXTRAS[1], 1.0).unsqueeze(0), 1 - time_outs])
        storage.num_steps, storage.step = steps, 0
    return storage

"""``RolloutStorage``'s attributes to and from a rollout file's datasets, row by row of the field table.

Duck-typed on the storage (this module does not import :mod:`rolloutcli.storage`, which imports it lazily).
Scalar fields are ``[T, N, 1]`` in the storage and ``[T, N]`` in the file (``last_values``: ``[N, 1]``, ``[N]``).
"""

from __future__ import annotations

from typing import Any

import torch

from rolloutcli.fields import FIELDS
from rolloutcli.hdf5.storage_io import Rollout

RL_ONLY = ("values", "actions_log_prob", "advantages", "returns")  # a distillation storage has none of these
NETS = (("actor", "saved_hidden_state_a"), ("critic", "saved_hidden_state_c"))


def fill_storage(storage: Any, loaded: Rollout) -> None:
    """Put every field of ``loaded`` into a freshly built storage of its shape."""
    tensors = loaded.tensors
    observations = {key: tensors[name] for key, name in loaded.observations.items()}
    if type(storage.observations).__name__ == "TensorDict":
        kind = type(storage.observations)
        storage.observations = kind(observations, batch_size=[loaded.T, loaded.N], device=storage.device)
    else:
        storage.observations = observations
    for row in FIELDS:
        if row.name in tensors and row.storage_name and not row.group:
            if storage.training_type == "rl" or row.name not in RL_ONLY:
                value = tensors[row.name]
                setattr(storage, row.storage_name, value.unsqueeze(-1) if row.trailing_one else value)
    if storage.training_type == "rl" and loaded.distribution:
        storage.distribution_names = loaded.distribution
        storage.distribution_params = tuple(tensors[f"distribution/{n}"] for n in loaded.distribution)
    for net, attribute in NETS:
        if loaded.hidden.get(net):
            setattr(storage, attribute, [tensors[p] for p in loaded.hidden[net]])
    storage.attrs = dict(loaded.attrs)
    storage.step = loaded.T
    _materialise(storage)


def _materialise(storage: Any) -> None:
    """The buffers the file did not fill, still on the meta device: zeros on the storage's device (``returns``
    and ``advantages`` so made are the storage's blanks: never computed)."""
    made = {}
    for key, value in list(vars(storage).items()):
        if isinstance(value, torch.Tensor) and value.is_meta:
            made[key] = torch.zeros(value.shape, dtype=value.dtype, device=storage.device)
            setattr(storage, key, made[key])
    if getattr(storage, "_blank", None) is not None:
        storage._blank = (made.get("returns", storage._blank[0]), made.get("advantages", storage._blank[1]))


def computed(storage: Any) -> bool:
    """Whether ``returns``/``advantages`` hold results, not the zeros a fresh storage starts with."""
    if storage.training_type != "rl":
        return False
    pairs = zip((storage.returns, storage.advantages), storage._blank, strict=True)
    return any(value is not blank or bool(value.any()) for value, blank in pairs)


def storage_tensors(storage: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every field of ``storage`` keyed by dataset path, and the attributes of its groups."""
    tensors = {f"observations/{key}": storage.observations[key] for key in storage.observations.keys()}
    done = computed(storage)
    for row in FIELDS:
        value = getattr(storage, row.storage_name, None) if row.storage_name and not row.group else None
        if value is None or (row.name in ("advantages", "returns") and not done):
            continue
        if row.trailing_one:
            value = value.reshape(value.shape[: row.env_axis + 1])
        tensors[row.name] = value.to(torch.uint8) if row.flag else value
    params = storage.distribution_params if storage.training_type == "rl" else None
    names = storage.distribution_names or [f"param{i}" for i in range(len(params or ()))]
    for name, param in zip(names, params or (), strict=True):
        tensors[f"distribution/{name}"] = param
    for net, attribute in NETS:
        for index, state in enumerate(getattr(storage, attribute) or ()):
            tensors[f"hidden_states/{net}/{index}"] = state
    return tensors, ({"distribution": {"order": names}} if storage.distribution_names and params else {})

"""``RolloutStorage.from_hdf5`` / ``to_hdf5``: a whole rollout file to and from a storage object."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, SafetyOptions, translate_hdf5_error
from rolloutcli.hdf5.writer import create_file, write_attrs, write_dataset

if TYPE_CHECKING:
    from rolloutcli.storage import RolloutStorage

DISTRIBUTION_ORDER_ATTR = "order"  # on the `distribution` group: parameter names in RSL-RL's tuple order


def distribution_order(reader: RolloutReader) -> list[str]:
    """Distribution parameter names in tuple order (the group's ``order`` attribute, else by name)."""
    names = sorted(n.split("/", 1)[1] for n in reader.schema.names("distribution"))
    group = reader.handle.get("distribution")
    declared = group.attrs.get(DISTRIBUTION_ORDER_ATTR) if group is not None else None
    if declared is not None:
        ordered = [d.decode() if isinstance(d, bytes) else str(d) for d in declared]
        if sorted(ordered) == names:
            return ordered
    return names


def _env_range(envs: slice | None, num_envs: int, path: Path) -> tuple[int, int]:
    if envs is None:
        return 0, num_envs
    start, stop, step = envs.indices(num_envs)
    if step != 1 or stop <= start:
        raise RolloutError(
            f"{path}: envs={envs!r} selects no contiguous env range of the file's N={num_envs} envs. "
            "Pass a slice such as slice(0, 128).",
            exit_code=EXIT_USAGE,
        )
    return start, stop


def load_storage(
    cls: type[RolloutStorage],
    path: Path,
    device: str | torch.device,
    envs: slice | None,
    training_type: str | None,
    allow_external: bool,
) -> RolloutStorage:
    """Read every field of ``path`` (env slice ``envs``) into a new storage of type ``cls``."""
    with RolloutReader(path, SafetyOptions(allow_external=allow_external)) as reader:
        schema = reader.schema
        start, stop = _env_range(envs, schema.N, path)

        def get(name: str) -> torch.Tensor:
            return reader.tensor(name, start, stop, device)

        if training_type is None:
            training_type = (
                "distillation" if "privileged_actions" in schema.fields and "values" not in schema.fields else "rl"
            )
        observations = {key: get(name) for key, name in schema.observation_keys.items()}
        actions = get("actions")
        example = {key: value[0] for key, value in observations.items()}
        storage = cls(training_type, stop - start, schema.T, example, tuple(actions.shape[2:]), device)
        for key, value in observations.items():
            storage.observations[key].copy_(value)
        storage.actions = actions
        storage.rewards = get("rewards").unsqueeze(-1)
        storage.dones = get("dones").unsqueeze(-1)
        if "time_outs" in schema.fields:
            storage.time_outs = get("time_outs").unsqueeze(-1)
        if "last_values" in schema.fields:
            storage.last_values = get("last_values").unsqueeze(-1)
        if "privileged_actions" in schema.fields:
            storage.privileged_actions = get("privileged_actions")
        if training_type == "rl":
            for name in ("values", "actions_log_prob", "advantages", "returns"):
                if name in schema.fields:
                    setattr(storage, name, get(name).unsqueeze(-1))
            names = distribution_order(reader)
            storage.distribution_names = names
            storage.distribution_params = tuple(get(f"distribution/{n}") for n in names) if names else None
        for net, attribute in (("actor", "saved_hidden_state_a"), ("critic", "saved_hidden_state_c")):
            paths = schema.hidden.get(net)
            if paths:
                setattr(storage, attribute, [get(p) for p in paths])
        storage.attrs = dict(schema.attrs)
        storage.step = schema.T
        return storage


def storage_tensors(storage: RolloutStorage) -> dict[str, torch.Tensor]:
    """Every field of a storage keyed by its rollout-file path (scalars as ``[T, N]``)."""
    tensors: dict[str, torch.Tensor] = {}
    for key in storage.observations.keys():
        tensors[f"observations/{key}"] = storage.observations[key]
    tensors["actions"] = storage.actions
    tensors["rewards"] = storage.rewards.squeeze(-1)
    tensors["dones"] = storage.dones.squeeze(-1).to(torch.uint8)
    for name in ("time_outs",):
        value = getattr(storage, name, None)
        if value is not None:
            tensors[name] = value.squeeze(-1).to(torch.uint8)
    if storage.last_values is not None:
        tensors["last_values"] = storage.last_values.reshape(-1)
    if storage.training_type == "distillation" or getattr(storage, "privileged_actions", None) is not None:
        tensors["privileged_actions"] = storage.privileged_actions
    if storage.training_type == "rl":
        for name in ("values", "actions_log_prob", "advantages", "returns"):
            tensors[name] = getattr(storage, name).squeeze(-1)
        params = storage.distribution_params or ()
        names = storage.distribution_names or [f"param{i}" for i in range(len(params))]
        for name, param in zip(names, params, strict=True):
            tensors[f"distribution/{name}"] = param
    for net, states in (("actor", storage.saved_hidden_state_a), ("critic", storage.saved_hidden_state_c)):
        for index, state in enumerate(states or ()):
            tensors[f"hidden_states/{net}/{index}"] = state
    return tensors


def save_storage(storage: RolloutStorage, path: Path, *, overwrite: bool) -> None:
    """Write ``storage`` as a rollout file at ``path`` (temporary file, then atomic rename)."""
    tensors = storage_tensors(storage)
    attrs: dict[str, Any] = {k: v for k, v in storage.attrs.items() if k not in ("rolloutcli_format", "format_version")}
    with atomic_file(path, overwrite=overwrite) as tmp:
        try:
            with create_file(tmp) as handle:
                write_attrs(handle, attrs)
                for name, value in tensors.items():
                    write_dataset(handle, name, value)
                if storage.distribution_names:
                    handle["distribution"].attrs["order"] = storage.distribution_names
        except HDF5_ERRORS as exc:
            raise translate_hdf5_error(path, exc) from exc

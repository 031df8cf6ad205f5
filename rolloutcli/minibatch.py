"""``Batch``: one mini-batch, as RSL-RL 5.x's ``RolloutStorage.Batch`` (the same attributes, read and assigned by
RSL-RL's ``PPO.update()`` and ``Distillation.update()``), made a torch citizen:

- a dataclass registered with torch's pytree (``torch.utils._pytree.tree_map`` reaches every tensor);
- ``.to(device, non_blocking=)`` and ``.pin_memory()`` (so ``DataLoader(pin_memory=True)`` really pins it);
- a repr listing its fields and shapes;
- ``DataLoader``'s default collation concatenates Batches along their batch dimension (:func:`collate_batches`).

Observations are a ``TensorDict`` (RSL-RL's type). Recurrent batches have no common batch dimension (observations
``[L, trajectories]``, actions ``[T, envs]``, hidden states ``[layers, trajectories, H]`` and pairs for an LSTM),
which is why a Batch is a dataclass and not itself a TensorDict. ``hidden_states`` unpacks as RSL-RL's
``(actor, critic)``: a tensor for a GRU, a tuple ``(h, c)`` for an LSTM, None without a recurrent network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.data._utils.collate import default_collate_fn_map

HiddenState = torch.Tensor | tuple[torch.Tensor, ...] | None


def _is_tensordict(value: Any) -> bool:
    return hasattr(value, "batch_size")  # a TensorDict (also a Mapping) rather than a plain dict


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], td: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor of a field (a tensor, a tuple, a dict), ``td`` to a TensorDict."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map(v, fn, td) for v in value)
    if _is_tensordict(value):
        return td(value)
    return {key: _map(v, fn, td) for key, v in value.items()}


def _is_empty_pair(value: Any) -> bool:
    return isinstance(value, tuple) and all(v is None for v in value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple):
        return f"({', '.join(_describe(v) for v in value)}{',' if len(value) == 1 else ''})"
    if value is None:
        return "None"
    items = value.items()
    return f"{type(value).__name__}({', '.join(f'{k}: {_describe(v)}' for k, v in items)})"


@dataclass(eq=False)
class Batch:
    """A mini-batch as RSL-RL's generators yield it (fields are None where a mode has none)."""

    observations: Any = None  # TensorDict (RSL-RL's type), or a dict with tensordict=False
    actions: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_actions_log_prob: torch.Tensor | None = None
    old_distribution_params: tuple[torch.Tensor, ...] | None = None
    hidden_states: tuple[HiddenState, HiddenState] = (None, None)
    masks: torch.Tensor | None = None
    privileged_actions: torch.Tensor | None = None
    dones: torch.Tensor | None = None

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], td: Callable[[Any], Any]) -> Batch:
        """A new Batch with ``fn`` applied to every tensor (``td`` to a TensorDict of observations)."""
        return replace(self, **{f.name: _map(getattr(self, f.name), fn, td) for f in fields(self)})

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        """A copy on ``device`` (tensors already there are kept, not copied)."""
        return self.apply(
            lambda t: t.to(device, non_blocking=non_blocking), lambda td: td.to(device, non_blocking=non_blocking)
        )

    def pin_memory(self, device: str | torch.device | None = None) -> Batch:
        """A copy in page-locked host memory (what ``DataLoader(pin_memory=True)`` calls on each batch)."""
        del device  # torch's pin-memory thread passes it on; pinning is for the current accelerator
        return self.apply(lambda t: t.pin_memory(), lambda td: td.pin_memory())

    def __repr__(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        shown = [f"{k}={_describe(v)}" for k, v in values.items() if v is not None and not _is_empty_pair(v)]
        return f"Batch({', '.join(shown)})"


pytree.register_dataclass(Batch, serialized_type_name="rolloutcli.Batch")


# ------------------------------------------------------------------------------------------------------ collation


def _pad_cat(values: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate along ``dim``; with ``dim=1``, first zero-pad axis 0 (time) to the longest."""
    if dim == 0:
        return torch.cat(list(values), 0)
    length = max(v.shape[0] for v in values)
    padded = []
    for v in values:
        if v.shape[0] < length:
            v = torch.cat([v, v.new_zeros((length - v.shape[0], *v.shape[1:]))], 0)
        padded.append(v)
    return torch.cat(padded, 1)


def _combine(values: Sequence[Any], dim: int, name: str) -> Any:
    first = values[0]
    if any((v is None) != (first is None) for v in values):
        raise ValueError(f"collate_batches: field '{name}' is None in some batches and not in others")
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return _pad_cat(values, dim)
    if isinstance(first, tuple):
        return tuple(_combine([v[i] for v in values], dim, f"{name}[{i}]") for i in range(len(first)))
    keys = list(first.keys())
    merged = {key: _pad_cat([v[key] for v in values], dim) for key in keys}
    if not _is_tensordict(first):
        return merged
    shape = next(iter(merged.values())).shape[: len(first.batch_size)] if merged else first.batch_size
    return type(first)(merged, batch_size=shape, device=first.device)


def collate_batches(batch: Sequence[Batch], *, collate_fn_map: Any = None) -> Batch:
    """Concatenate Batches along their batch dimension (``DataLoader``'s default collation of Batches).

    Feed-forward and distillation batches (no ``masks``): every field along axis 0 (rows). Recurrent batches
    (``masks`` ``[L, M]``): every ``[L, ...]`` field zero-padded to the longest ``L`` and concatenated along axis 1
    (trajectories, or envs), hidden states ``[layers, M, H]`` along axis 1 too.
    """
    del collate_fn_map
    recurrent = batch[0].masks is not None
    out = {}
    for f in fields(Batch):
        values = [getattr(b, f.name) for b in batch]
        if f.name == "hidden_states":
            nets = [_combine([v[i] for v in values], 1, f"hidden_states[{i}]") for i in (0, 1)]
            out[f.name] = (nets[0], nets[1])
        else:
            out[f.name] = _combine(values, 1 if recurrent else 0, f.name)
    return Batch(**out)


default_collate_fn_map[Batch] = collate_batches  # torch's documented extension point of default_collate

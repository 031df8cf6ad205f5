"""A batched ring buffer of tensor history: Isaac Lab's ``CircularBuffer`` plus the AMP replay sampler.

Semantics (``isaaclab.utils.buffers.CircularBuffer``): each environment keeps its last ``max_len`` entries; the
first append after a reset fills its whole history with the entry; ``buffer[key]`` reads LIFO (``key[i] == 0``
is environment ``i``'s newest entry), keys beyond the stored history read the oldest stored entry (Isaac Lab
clamps to ``num_pushes - 1`` only, so there a key ``>= max_len`` on a wrapped buffer reads a newer one), and an
environment reset and not appended to since reads as zeros.

Invariant: ``append``, ``__getitem__`` and ``reset`` never synchronise the host with the device: they run every
step of a GPU simulation. Negative keys are therefore checked only when that is free (keys on the CPU) or asked
for (``debug=True``); otherwise they read the newest entry, as in Isaac Lab.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from rolloutcli.core.batching import split_sizes

BatchIds = Sequence[int] | slice | torch.Tensor | None

# Resets between two appends are kept as index objects, so the next append writes only those histories; past
# this many it makes one torch.where pass over the whole buffer instead.
_MAX_PENDING_FILLS = 8


def _positive_int(value: object, name: str) -> int:
    """``value`` as a Python int >= 1, else TypeError (not an integer) / ValueError (< 1)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r}).")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r}).") from exc
    if number < 1:
        raise ValueError(f"{name} must be at least 1, got {number}.")
    return number


class CircularBuffer:
    """Per-environment history of the last ``max_len`` entries of ``batch_size`` environments on ``device``.

    ``debug``: also validate keys on an accelerator (negative keys raise ``ValueError``), which synchronises the
    host with the device on every read. Keys on the CPU are always validated.
    """

    def __init__(self, max_len: int, batch_size: int, device: str | torch.device, *, debug: bool = False) -> None:
        self._max_len = _positive_int(max_len, "max_len")
        self._batch_size = _positive_int(batch_size, "batch_size")
        self._device_arg = device
        self._device = torch.device(device)
        self._debug = bool(debug)
        self._all_indices = torch.arange(self._batch_size, device=self._device)
        self._num_pushes = torch.zeros(self._batch_size, dtype=torch.long, device=self._device)
        self._pointer: int = self._max_len - 1  # storage slot of the newest entry
        self._buffer: torch.Tensor | None = None  # allocated by the first append
        # Environments whose history the next append fills: "all", "where" (those with num_pushes == 0, found
        # by torch.where), or the index objects given to reset().
        self._fill: Literal["all", "where"] | list[slice | list[int] | torch.Tensor] = "all"

    @property
    def batch_size(self) -> int:
        """Number of environments (the first dimension of appended data)."""
        return self._batch_size

    @property
    def device(self) -> str | torch.device:
        """The device given to the constructor, as given (Isaac Lab returns the string)."""
        return self._device_arg

    @property
    def max_length(self) -> int:
        """Entries kept per environment."""
        return self._max_len

    @property
    def current_length(self) -> torch.Tensor:
        """Entries stored per environment, ``min(appends since reset, max_length)``; ``[batch]`` int64."""
        return self._num_pushes.clamp(max=self._max_len)

    @property
    def num_pushes(self) -> torch.Tensor:
        """Appends since each environment's last reset (not capped); ``[batch]`` int64, a copy."""
        return self._num_pushes.clone()

    @property
    def buffer(self) -> torch.Tensor:
        """A copy of the whole history, ``[batch, max_length, *entry_shape]``, oldest to newest along dim 1
        (a transposed copy, as in Isaac Lab). RuntimeError before the first append."""
        storage = self._require_data("read the buffer")
        return torch.cat([storage[self._pointer + 1 :], storage[: self._pointer + 1]]).transpose(0, 1)

    @property
    def entry_shape(self) -> torch.Size | None:
        """Shape of one environment's entry, fixed by the first append; None before."""
        return None if self._buffer is None else self._buffer.shape[2:]

    @property
    def dtype(self) -> torch.dtype | None:
        """Dtype of the entries, fixed by the first append; None before."""
        return None if self._buffer is None else self._buffer.dtype

    def __repr__(self) -> str:
        shape = None if self._buffer is None else tuple(self._buffer.shape[2:])
        return (
            f"CircularBuffer(max_len={self._max_len}, batch_size={self._batch_size}, "
            f"device={str(self._device)!r}, entry_shape={shape}, dtype={self.dtype})"
        )

    def reset(self, batch_ids: BatchIds = None) -> None:
        """Forget the history of some environments (zero it, restart their count); the next :meth:`append`
        fills it. ``batch_ids``: None (all), a slice, a sequence of ints, or an integer or boolean-mask tensor."""
        index: slice | list[int] | torch.Tensor
        if batch_ids is None:
            index = slice(None)
        elif isinstance(batch_ids, slice):
            index = batch_ids
        elif isinstance(batch_ids, torch.Tensor) and batch_ids.dtype == torch.bool:
            return self._reset_mask(batch_ids)
        elif isinstance(batch_ids, torch.Tensor):
            if batch_ids.is_floating_point() or batch_ids.is_complex():
                raise TypeError(f"batch_ids must hold integers or booleans, got dtype {batch_ids.dtype}.")
            # A private copy on the device: the caller may reuse its tensor before the next append.
            index = batch_ids.to(self._device, copy=True).reshape(-1)
        else:
            index = [operator.index(i) for i in batch_ids]
        count = len(range(self._batch_size)[index]) if isinstance(index, slice) else len(index)
        if count == 0:
            return  # an empty reset must not arm a fill
        self._num_pushes[index] = 0
        if self._buffer is not None:
            self._buffer[:, index] = 0
        if isinstance(self._fill, list):
            if isinstance(index, slice) and index == slice(None):
                self._fill = "all"
            elif len(self._fill) >= _MAX_PENDING_FILLS:
                self._fill = "where"
            else:
                self._fill.append(index)

    def _reset_mask(self, mask: torch.Tensor) -> None:
        """Reset the environments where ``mask [batch]`` is True, without boolean indexing (which syncs)."""
        if mask.shape != (self._batch_size,):
            raise ValueError(
                f"A boolean batch_ids mask must have shape ({self._batch_size},), got {tuple(mask.shape)}."
            )
        mask = mask.to(self._device)
        self._num_pushes.masked_fill_(mask, 0)
        if self._buffer is not None:
            self._buffer.masked_fill_(mask.view(1, self._batch_size, *([1] * (self._buffer.dim() - 2))), 0)
        if self._fill != "all":
            self._fill = "where"

    def append(self, data: torch.Tensor) -> None:
        """Append ``data [batch, *entry_shape]`` (moved to the buffer's device); the first append fixes the entry
        shape and dtype (another later: ValueError / TypeError)."""
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"append() expects a torch.Tensor [batch, ...], got {type(data).__name__}.")
        if data.dim() == 0 or data.shape[0] != self._batch_size:
            found = "a 0-d tensor" if data.dim() == 0 else f"batch size {data.shape[0]}"
            raise ValueError(f"append() expects data [batch={self._batch_size}, ...], got {found}.")
        if self._buffer is None:
            self._buffer = torch.empty((self._max_len, *data.shape), dtype=data.dtype, device=self._device)
        elif data.shape[1:] != self._buffer.shape[2:]:
            raise ValueError(
                f"append() expects entries of shape {tuple(self._buffer.shape[2:])} (fixed by the first append), "
                f"got {tuple(data.shape[1:])}."
            )
        elif data.dtype != self._buffer.dtype:
            raise TypeError(
                f"append() expects dtype {self._buffer.dtype} (fixed by the first append), got {data.dtype}."
            )
        data = data.to(self._device)
        self._pointer = (self._pointer + 1) % self._max_len
        self._buffer[self._pointer] = data
        if self._fill == "all":
            self._buffer[:] = data.unsqueeze(0)
        elif self._fill == "where":
            fresh = (self._num_pushes == 0).view(1, self._batch_size, *([1] * (data.dim() - 1)))
            torch.where(fresh, data.unsqueeze(0), self._buffer, out=self._buffer)
        else:
            for index in self._fill:
                self._buffer[:, index] = data[index].unsqueeze(0)
        self._fill = []
        self._num_pushes += 1

    def __getitem__(self, key: torch.Tensor) -> torch.Tensor:
        """Read one entry per environment, LIFO: ``key [batch]`` (integers, any device) counts appends back from
        each environment's newest; returns a new ``[batch, *entry_shape]`` tensor."""
        if not isinstance(key, torch.Tensor):
            raise TypeError(f"The key must be a [batch] integer tensor, got {type(key).__name__}.")
        if key.is_floating_point() or key.is_complex() or key.dtype == torch.bool:
            raise TypeError(f"The key must be a [batch] integer tensor, got dtype {key.dtype}.")
        if key.shape != (self._batch_size,):
            raise ValueError(f"The key must have shape ({self._batch_size},), got {tuple(key.shape)}.")
        storage = self._require_data("read from the buffer")
        if (self._debug or key.device.type == "cpu") and bool((key < 0).any()):
            raise ValueError(f"Keys count appends back from the newest entry and must be >= 0, got {int(key.min())}.")
        # Clamp to the stored history; fresh environments get 0, their zeroed slot.
        stored = self._num_pushes.clamp(max=self._max_len) - 1
        steps_back = torch.minimum(key.to(self._device), stored).clamp_(min=0)
        return self._gather(storage, steps_back, self._all_indices)

    def _gather(self, storage: torch.Tensor, steps_back: torch.Tensor, envs: torch.Tensor) -> torch.Tensor:
        """``storage[slot of steps_back, envs]`` for ``[n]`` index tensors, as one row ``index_select``."""
        slots = torch.remainder(self._pointer - steps_back, self._max_len)
        return storage.flatten(0, 1).index_select(0, slots * self._batch_size + envs)

    def _require_data(self, action: str) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError(f"Cannot {action}: nothing has been appended yet. Call append(data) first.")
        return self._buffer

    def mini_batch_generator(
        self,
        fetch_length: int,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        generator: torch.Generator | None = None,
        window: int | None = None,
        return_indices: bool = False,
    ) -> Iterator[Any]:
        """Draw (history index, environment) pairs once, then yield them in mini-batches for several epochs.

        Eligible pairs are each environment's newest ``min(window, current_length)`` entries (``window >=
        fetch_length``, default ``fetch_length``; ``window=max_length`` draws from the whole history, as AMP
        replay does). ``n = min(batch_size * fetch_length, E)`` of the ``E`` eligible pairs are drawn uniformly
        without replacement and copied at call time. Each epoch yields them once, in a fresh order, as
        ``num_mini_batches`` mini-batches whose sizes differ by at most one: ``[size, *entry_shape]``, or with
        ``return_indices`` ``(batch, steps_back, env_ids)``. Synchronises once per call, to learn ``E``.
        """
        storage = self._require_data("sample mini-batches")
        fetch_length, num_mini_batches, num_epochs, window = self._check_sampling(
            fetch_length, num_mini_batches, num_epochs, window, generator
        )
        depth = min(window, self._max_len)
        limit = self._num_pushes.clamp(max=depth)  # [batch] eligible entries per environment
        eligible = (torch.arange(depth, device=self._device).unsqueeze(1) < limit).flatten()  # (k, b): k * batch + b
        available = int(limit.sum())  # the one synchronisation
        if available == 0:
            raise ValueError("No history to sample: every environment was reset since its last append.")
        count = min(self._batch_size * fetch_length, available)
        if count < num_mini_batches:
            raise ValueError(
                f"Only {count} (history, env) pairs are available (sum of min(window, current_length) over "
                f"environments), fewer than num_mini_batches={num_mini_batches}."
            )
        perm = torch.randperm(depth * self._batch_size, generator=generator, device=self._device)
        # A stable sort puts eligible pairs first, keeping their random order: a uniform draw without replacement.
        chosen = perm[torch.argsort((~eligible[perm]).to(torch.uint8), stable=True)[:count]]
        steps_back = torch.div(chosen, self._batch_size, rounding_mode="floor")
        env_ids = torch.remainder(chosen, self._batch_size)
        samples = self._gather(storage, steps_back, env_ids)
        sizes = split_sizes(count, num_mini_batches)

        def epochs() -> Iterator[Any]:  # a generator of its own, so that the checks above run at call time
            for _ in range(num_epochs):
                order = torch.randperm(count, generator=generator, device=self._device)
                for pick in torch.split(order, sizes):
                    batch = samples.index_select(0, pick)
                    yield (batch, steps_back[pick], env_ids[pick]) if return_indices else batch

        return epochs()

    def _check_sampling(
        self, fetch_length: int, num_mini_batches: int, num_epochs: int, window: int | None, generator: Any
    ) -> tuple[int, int, int, int]:
        """The arguments of :meth:`mini_batch_generator` as ints, after checking their ranges."""
        fetch_length = _positive_int(fetch_length, "fetch_length")
        num_mini_batches = _positive_int(num_mini_batches, "num_mini_batches")
        num_epochs = operator.index(num_epochs)
        if num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0, got {num_epochs}.")
        if fetch_length > self._max_len:
            raise ValueError(
                f"fetch_length {fetch_length} exceeds the history this buffer can hold (max_length "
                f"{self._max_len}). Use fetch_length <= {self._max_len} or a longer buffer."
            )
        window = fetch_length if window is None else _positive_int(window, "window")
        if window < fetch_length:
            raise ValueError(f"window ({window}) must be at least fetch_length ({fetch_length}).")
        if generator is not None and generator.device.type != self._device.type:
            raise ValueError(f"generator is on {generator.device}, the buffer on {self._device}; use one device.")
        return fetch_length, num_mini_batches, num_epochs, window

    def state_dict(self) -> dict[str, Any]:
        """The state as copies: ``max_length``, ``batch_size``, ``pointer`` (storage slot of the newest entry),
        ``num_pushes [batch]`` int64 and ``data [max_length, batch, ...]`` (None before the first append)."""
        return {
            "max_length": self._max_len,
            "batch_size": self._batch_size,
            "pointer": self._pointer,
            "num_pushes": self._num_pushes.clone(),
            "data": None if self._buffer is None else self._buffer.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state with ``state`` (from :meth:`state_dict`), moved to this buffer's device; ValueError or
        TypeError for a state that does not fit (one synchronisation, to check ``num_pushes``)."""
        if missing := {"max_length", "batch_size", "pointer", "num_pushes", "data"} - set(state):
            raise ValueError(f"state_dict is missing {sorted(missing)}.")
        for name, mine in (("max_length", self._max_len), ("batch_size", self._batch_size)):
            if operator.index(state[name]) != mine:
                raise ValueError(f"state_dict has {name}={state[name]}, this buffer {mine}.")
        pointer = operator.index(state["pointer"])
        if not 0 <= pointer < self._max_len:
            raise ValueError(f"state_dict pointer {pointer} is outside [0, {self._max_len}).")
        num_pushes, data = state["num_pushes"], state["data"]
        if not isinstance(num_pushes, torch.Tensor) or num_pushes.is_floating_point() or num_pushes.is_complex():
            raise TypeError("state_dict['num_pushes'] must be an integer tensor.")
        if num_pushes.shape != (self._batch_size,) or bool((num_pushes < 0).any()):
            raise ValueError(f"state_dict num_pushes must be ({self._batch_size},) counts >= 0.")
        if data is None and bool((num_pushes != 0).any()):
            raise ValueError("state_dict has appends counted (num_pushes > 0) but no data.")
        if data is not None and not isinstance(data, torch.Tensor):
            raise TypeError(f"state_dict['data'] must be a tensor or None, got {type(data).__name__}.")
        if data is not None and (data.dim() < 2 or tuple(data.shape[:2]) != (self._max_len, self._batch_size)):
            raise ValueError(
                f"state_dict data has shape {tuple(data.shape)}, expected ({self._max_len}, {self._batch_size}, ...)."
            )
        self._pointer = pointer
        self._num_pushes = num_pushes.to(self._device, dtype=torch.long, copy=True)
        self._buffer = None if data is None else data.to(self._device, copy=True).contiguous()
        self._fill = "all" if data is None else "where"

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the state to an HDF5 file atomically; RolloutError when it exists without ``overwrite``."""
        from rolloutcli.hdf5.buffer_io import save_buffer_state

        save_buffer_state(self.state_dict(), Path(path), overwrite=overwrite)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        *,
        debug: bool = False,
        max_memory: int | None = None,
        allow_external: bool = False,
    ) -> CircularBuffer:
        """Build a buffer from a file written by :meth:`save`, on ``device``.

        The file is read with the commands' safety checks; a state larger than ``max_memory`` bytes (default: the
        commands' ``--max-memory``) is refused before it is read.
        """
        from rolloutcli.hdf5.buffer_io import load_buffer_state

        state = load_buffer_state(Path(path), max_memory=max_memory, allow_external=allow_external)
        buffer = cls(state["max_length"], state["batch_size"], device, debug=debug)
        buffer.load_state_dict(state)
        return buffer

"""A batched ring buffer of tensor history: Isaac Lab's ``CircularBuffer`` plus the AMP replay sampler.

Semantics (compatible with ``isaaclab.utils.buffers.CircularBuffer``):

* ``CircularBuffer(max_len, batch_size, device)`` keeps, for each of ``batch_size`` environments, the last
  ``max_len`` entries appended to it. Storage is one tensor ``[max_len, batch, ...]`` with a write position
  shared by all environments (every ``append`` writes one entry for every environment) and a per-environment
  count of appends since that environment's last reset.
* ``append(data)`` takes ``data [batch, ...]``; the first append fixes the entry shape and dtype. The first
  append after a reset (and the very first append) fills *the whole history* of that environment with the
  entry, so reads further back than the stored history return the oldest stored entry.
* ``buffer[key]`` with ``key [batch]`` integers reads in LIFO order: ``key[i] == 0`` is environment ``i``'s
  newest entry, ``k`` is ``k`` appends back, keys beyond the stored history clamp to the oldest stored entry.
  (Isaac Lab clamps to ``num_pushes - 1`` only, so there a key ``>= max_len`` on a wrapped buffer reads a
  newer entry; here it reads the oldest stored one, as the documented semantics say.)
  An environment that was reset and not appended to since reads as zeros (its history was zeroed).
* ``reset(batch_ids)`` zeroes the history of those environments and restarts their count.

No host-device synchronisation happens in :meth:`CircularBuffer.append` or :meth:`CircularBuffer.__getitem__`
(no ``.item()``, no Python ``if`` on tensor values): the write position is a Python integer that advances
identically for all environments, and the "fill the history of fresh environments" step uses the indices
given to :meth:`CircularBuffer.reset` (or a ``torch.where`` over the whole buffer after
:meth:`CircularBuffer.load_state_dict`), never a data-dependent branch.

Negative keys: validating them needs their values on the host. They are therefore checked (``ValueError``)
only when that is free or requested: when the key tensor is on the CPU, or when the buffer was built with
``debug=True``. A negative key that is not checked reads the newest entry (it is clamped to 0, as Isaac Lab
does).

This module is pure torch; HDF5 persistence lives in :mod:`rolloutcli.hdf5.buffer_io` and is imported only
when :meth:`CircularBuffer.save` or :meth:`CircularBuffer.load` is called.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch

BatchIds = Sequence[int] | slice | torch.Tensor | None

# Several resets between two appends are remembered individually (cheap index writes at the next append);
# beyond this many the next append falls back to one ``torch.where`` pass over the whole buffer.
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
    """Per-environment history of the last ``max_len`` batched entries, on any torch device.

    Shapes: entries are ``[batch, *entry_shape]``; the storage is ``[max_len, batch, *entry_shape]``;
    :attr:`buffer` returns ``[batch, max_len, *entry_shape]`` ordered oldest to newest.

    Args:
        max_len: Entries kept per environment (>= 1).
        batch_size: Number of environments (>= 1); the first dimension of every appended tensor.
        device: Where the history lives (``"cpu"``, ``"cuda:0"``, ...). Appended data is moved there.
        debug: Also validate keys that live on an accelerator (negative keys raise ``ValueError``); this
            synchronises the host with the device on every read, so it is off by default. Keys on the CPU
            are always validated.

    Raises:
        TypeError: ``max_len`` or ``batch_size`` is not an integer.
        ValueError: ``max_len`` or ``batch_size`` is less than 1.
    """

    def __init__(self, max_len: int, batch_size: int, device: str | torch.device, *, debug: bool = False) -> None:
        self._max_len = _positive_int(max_len, "max_len")
        self._batch_size = _positive_int(batch_size, "batch_size")
        self._device_arg = device
        self._device = torch.device(device)
        self._debug = bool(debug)
        self._all_indices = torch.arange(self._batch_size, device=self._device)
        # Appends since each environment's last reset, [batch] int64 on the device.
        self._num_pushes = torch.zeros(self._batch_size, dtype=torch.long, device=self._device)
        # Storage slot of the newest entry; the next append writes slot (pointer + 1) % max_len.
        self._pointer: int = self._max_len - 1
        # [max_len, batch, *entry_shape], allocated by the first append.
        self._buffer: torch.Tensor | None = None
        # Environments whose history the next append must fill: "all", "where" (find them with torch.where,
        # used after load_state_dict), or a list of index objects given to reset().
        self._fill: Literal["all", "where"] | list[slice | list[int] | torch.Tensor] = "all"

    # ------------------------------------------------------------------ properties

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
        """A copy of the whole history, ``[batch, max_length, *entry_shape]``, oldest to newest along dim 1.

        The copy is made in storage layout and returned transposed (not contiguous, as in Isaac Lab); call
        ``.contiguous()`` if a contiguous tensor is needed.

        Slots older than an environment's stored history hold its oldest stored entry (the fill of its first
        append); an environment reset and not appended to since is all zeros.

        Raises:
            RuntimeError: Nothing has been appended yet.
        """
        storage = self._require_data("read the buffer")
        newest = self._pointer
        # Storage slots newest+1 .. end are the oldest entries. torch.cat always copies; the transpose is a view
        # of that copy (as in Isaac Lab), much cheaper than producing a contiguous [batch, max_len] layout.
        return torch.cat([storage[newest + 1 :], storage[: newest + 1]]).transpose(0, 1)

    @property
    def entry_shape(self) -> torch.Size | None:
        """Shape of one environment's entry (``data.shape[1:]``), fixed by the first append; None before."""
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

    # ------------------------------------------------------------------ operations

    def reset(self, batch_ids: BatchIds = None) -> None:
        """Forget the history of some environments: zero their data and restart their count.

        The next :meth:`append` fills the whole history of these environments with its entry.

        Args:
            batch_ids: Environments to reset: None (all), a slice, a sequence of ints, or an integer (or
                boolean mask) tensor. Indices are not range-checked beyond what torch indexing does.
        """
        index: slice | list[int] | torch.Tensor
        if batch_ids is None:
            index = slice(None)
        elif isinstance(batch_ids, slice):
            index = batch_ids
        elif isinstance(batch_ids, torch.Tensor):
            if batch_ids.dtype == torch.bool:
                self._reset_mask(batch_ids)
                return
            if batch_ids.is_floating_point() or batch_ids.is_complex():
                raise TypeError(f"batch_ids must hold integers or booleans, got dtype {batch_ids.dtype}.")
            # A private copy on the device: the caller may reuse its tensor before the next append.
            index = batch_ids.to(self._device, copy=True).reshape(-1)
        else:
            index = [operator.index(i) for i in batch_ids]
        if self._count(index) == 0:
            return  # an empty reset must not arm a fill
        self._num_pushes[index] = 0
        if self._buffer is not None:
            self._buffer[:, index] = 0
        if self._fill == "all" or self._fill == "where":
            return
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

    def _count(self, index: slice | list[int] | torch.Tensor) -> int:
        """How many entries an index object names (a length from shapes only: no synchronisation)."""
        if isinstance(index, slice):
            return len(range(self._batch_size)[index])
        if isinstance(index, torch.Tensor):
            return index.numel()
        return len(index)

    def append(self, data: torch.Tensor) -> None:
        """Append one entry for every environment.

        Args:
            data: ``[batch, *entry_shape]``; moved to the buffer's device. The first append fixes
                ``entry_shape`` and the dtype.

        Raises:
            TypeError: ``data`` is not a tensor, or its dtype differs from the first append's.
            ValueError: ``data`` has no batch dimension, a batch size other than :attr:`batch_size`, or an
                entry shape other than the first append's.
        """
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
        fill = self._fill
        if fill == "all":
            self._buffer[:] = data.unsqueeze(0)
        elif fill == "where":
            fresh = (self._num_pushes == 0).view(1, self._batch_size, *([1] * (data.dim() - 1)))
            torch.where(fresh, data.unsqueeze(0), self._buffer, out=self._buffer)
        else:
            for index in fill:
                self._buffer[:, index] = data[index].unsqueeze(0)
        if fill:
            self._fill = []
        self._num_pushes += 1

    def __getitem__(self, key: torch.Tensor) -> torch.Tensor:
        """Read one entry per environment, LIFO: ``key[i]`` appends back from environment ``i``'s newest.

        Keys larger than an environment's stored history read its oldest stored entry; an environment reset
        and not appended to since reads as zeros.

        Args:
            key: ``[batch]`` integer tensor (any device; moved to the buffer's device).

        Returns:
            ``[batch, *entry_shape]``, a new tensor.

        Raises:
            TypeError: ``key`` is not an integer tensor.
            ValueError: ``key`` is not ``[batch]``; or it has negative values and is on the CPU (or the buffer
                was built with ``debug=True``).
            RuntimeError: Nothing has been appended yet.
        """
        if not isinstance(key, torch.Tensor):
            raise TypeError(f"The key must be a [batch] integer tensor, got {type(key).__name__}.")
        if key.is_floating_point() or key.is_complex() or key.dtype == torch.bool:
            raise TypeError(f"The key must be a [batch] integer tensor, got dtype {key.dtype}.")
        if key.shape != (self._batch_size,):
            raise ValueError(f"The key must have shape ({self._batch_size},), got {tuple(key.shape)}.")
        storage = self._require_data("read from the buffer")
        if (self._debug or key.device.type == "cpu") and bool((key < 0).any()):
            raise ValueError(f"Keys count appends back from the newest entry and must be >= 0, got {int(key.min())}.")
        key = key.to(self._device)
        # Clamp to the stored history, min(num_pushes, max_len) - 1. (Isaac Lab clamps to num_pushes - 1 only,
        # so there a key >= max_len wraps around to a newer entry.) Fresh envs get 0: their zeroed slot.
        stored = self._num_pushes.clamp(max=self._max_len) - 1
        steps_back = torch.minimum(key, stored).clamp_(min=0)
        slots = torch.remainder(self._pointer - steps_back, self._max_len)
        return self._gather(storage, slots, self._all_indices)

    def _gather(self, storage: torch.Tensor, slots: torch.Tensor, envs: torch.Tensor) -> torch.Tensor:
        """``storage[slots, envs]`` for ``[n]`` index tensors, as one ``index_select`` (about 2x faster)."""
        flat = storage.view(self._max_len * self._batch_size, *storage.shape[2:])
        return flat.index_select(0, slots * self._batch_size + envs)

    def _require_data(self, action: str) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError(f"Cannot {action}: nothing has been appended yet. Call append(data) first.")
        return self._buffer

    # ------------------------------------------------------------------ AMP replay sampling

    @overload
    def mini_batch_generator(
        self,
        fetch_length: int,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        generator: torch.Generator | None = None,
        window: int | None = None,
        return_indices: Literal[False] = False,
    ) -> Iterator[torch.Tensor]: ...

    @overload
    def mini_batch_generator(
        self,
        fetch_length: int,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        generator: torch.Generator | None = None,
        window: int | None = None,
        return_indices: Literal[True],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...

    def mini_batch_generator(
        self,
        fetch_length: int,
        num_mini_batches: int,
        num_epochs: int = 8,
        *,
        generator: torch.Generator | None = None,
        window: int | None = None,
        return_indices: bool = False,
    ) -> Iterator[torch.Tensor] | Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Sample (history index, environment) pairs once, then yield them in mini-batches for several epochs.

        Sampling rule (drawn once, when this method is called):

        * Eligible pairs: for each environment ``b``, its newest ``min(window, current_length[b])`` entries,
          i.e. the pairs ``(k, b)`` with ``k`` appends back, ``0 <= k < min(window, current_length[b])``.
          ``window`` defaults to ``fetch_length`` ("the last ``fetch_length`` entries of each env"). Entries an
          environment does not hold (it was reset more recently) are never drawn; in particular the fill
          copies of its first entry are not.
        * Draw ``n = min(batch_size * fetch_length, E)`` distinct pairs uniformly without replacement from the
          ``E`` eligible pairs. With ``window == fetch_length`` and every environment holding at least
          ``fetch_length`` entries this is all ``batch_size * fetch_length`` of them; when environments hold
          less, ``n = E = sum(min(fetch_length, current_length))``. Pass ``window=max_length`` to draw from the
          whole stored history, as the AMP replay code does.
        * The drawn entries are gathered (copied) at call time, so later appends do not change what is yielded.

        Each epoch yields ``num_mini_batches`` mini-batches in a fresh random order (a new permutation of the
        ``n`` drawn pairs per epoch; every drawn pair appears exactly once per epoch).

        Remainder rule: when ``n`` is not a multiple of ``num_mini_batches`` the remainder is spread, the first
        ``n % num_mini_batches`` mini-batches of an epoch hold one pair more than the others (sizes differ by at
        most one). When it divides, every mini-batch is ``[n // num_mini_batches, *entry_shape]``.

        This method synchronises once per call (to learn ``E``); iterating does not synchronise.

        Args:
            fetch_length: Entries per environment to draw, ``1 <= fetch_length <= max_length``.
            num_mini_batches: Mini-batches per epoch (>= 1, <= n).
            num_epochs: Epochs (>= 0).
            generator: Random source, on the buffer's device (``torch.Generator(device=...)``); None uses
                torch's default generator for that device.
            window: How many of each environment's newest entries are eligible (``>= fetch_length``; values
                above ``max_length`` mean the whole history). Default: ``fetch_length``.
            return_indices: Yield ``(batch, steps_back, env_ids)`` instead of ``batch``, where
                ``batch[j] == buffer[env_ids[j], max_length - 1 - steps_back[j]]``.

        Yields:
            ``[mini_batch_size, *entry_shape]`` tensors, or with ``return_indices`` a tuple of that and two
            ``[mini_batch_size]`` int64 tensors (``steps_back``: appends back from the newest, ``env_ids``).

        Raises:
            RuntimeError: Nothing has been appended yet.
            ValueError: ``fetch_length`` exceeds ``max_length`` (more history than the buffer can hold) or is
                < 1; ``window < fetch_length``; no environment holds any entry (all reset since their last
                append); fewer pairs than ``num_mini_batches``; ``num_epochs < 0``; ``generator`` on another
                device type.
        """
        storage = self._require_data("sample mini-batches")
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

        depth = min(window, self._max_len)
        limit = self._num_pushes.clamp(max=depth)  # [batch] eligible entries per environment
        steps = torch.arange(depth, device=self._device)
        eligible = (steps.unsqueeze(1) < limit.unsqueeze(0)).flatten()  # [depth * batch], (k, b) -> k * batch + b
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
        # Stable sort puts eligible pairs first, keeping their random order: a uniform draw without replacement.
        first_eligible = torch.argsort((~eligible[perm]).to(torch.uint8), stable=True)
        chosen = perm[first_eligible[:count]]
        steps_back = torch.div(chosen, self._batch_size, rounding_mode="floor")
        env_ids = torch.remainder(chosen, self._batch_size)
        samples = self._gather(storage, torch.remainder(self._pointer - steps_back, self._max_len), env_ids)
        return self._epochs(samples, steps_back, env_ids, num_mini_batches, num_epochs, generator, return_indices)

    def _epochs(
        self,
        samples: torch.Tensor,
        steps_back: torch.Tensor,
        env_ids: torch.Tensor,
        num_mini_batches: int,
        num_epochs: int,
        generator: torch.Generator | None,
        return_indices: bool,
    ) -> Iterator[Any]:
        """Yield ``samples [n, ...]`` in ``num_mini_batches`` pieces per epoch, reshuffled every epoch."""
        count = samples.shape[0]
        base, extra = divmod(count, num_mini_batches)
        bounds = [0]
        for i in range(num_mini_batches):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        for _ in range(num_epochs):
            order = torch.randperm(count, generator=generator, device=self._device)
            for start, stop in itertools.pairwise(bounds):
                pick = order[start:stop]
                if return_indices:
                    yield samples.index_select(0, pick), steps_back[pick], env_ids[pick]
                else:
                    yield samples.index_select(0, pick)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """The buffer's state, as copies on the buffer's device.

        Returns:
            ``{"max_length": int, "batch_size": int, "pointer": int (storage slot of the newest entry),
            "num_pushes": [batch] int64 (appends since each reset), "data": [max_length, batch, *entry_shape]
            in storage order, or None before the first append}``.
        """
        return {
            "max_length": self._max_len,
            "batch_size": self._batch_size,
            "pointer": self._pointer,
            "num_pushes": self._num_pushes.clone(),
            "data": None if self._buffer is None else self._buffer.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this buffer's state with ``state`` (as returned by :meth:`state_dict`), moved to its device.

        The entry shape and dtype become those of ``state["data"]``. Validation reads ``num_pushes`` on the
        host (one synchronisation).

        Raises:
            ValueError: Missing keys, a ``max_length``/``batch_size`` other than this buffer's, a pointer out
                of range, negative counts, shapes that do not fit, or counts without data.
            TypeError: Values of the wrong type.
        """
        missing = {"max_length", "batch_size", "pointer", "num_pushes", "data"} - set(state)
        if missing:
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
        if num_pushes.shape != (self._batch_size,):
            raise ValueError(
                f"state_dict num_pushes has shape {tuple(num_pushes.shape)}, expected ({self._batch_size},)."
            )
        if bool((num_pushes < 0).any()):
            raise ValueError("state_dict num_pushes has negative counts.")
        if data is None:
            if bool((num_pushes != 0).any()):
                raise ValueError("state_dict has appends counted (num_pushes > 0) but no data.")
        elif not isinstance(data, torch.Tensor):
            raise TypeError(f"state_dict['data'] must be a tensor or None, got {type(data).__name__}.")
        elif data.dim() < 2 or tuple(data.shape[:2]) != (self._max_len, self._batch_size):
            raise ValueError(
                f"state_dict data has shape {tuple(data.shape)}, expected ({self._max_len}, {self._batch_size}, ...)."
            )
        self._pointer = pointer
        self._num_pushes = num_pushes.to(self._device, dtype=torch.long, copy=True)
        self._buffer = None if data is None else data.to(self._device, copy=True).contiguous()
        self._fill = "all" if data is None else "where"

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the state to an HDF5 file atomically (see :mod:`rolloutcli.hdf5.buffer_io`).

        Raises:
            RolloutError: The destination exists without ``overwrite`` (exit 2), or cannot be written (exit 3).
        """
        from rolloutcli.hdf5.buffer_io import save_buffer_state

        save_buffer_state(self.state_dict(), Path(path), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", *, debug: bool = False) -> CircularBuffer:
        """Build a buffer from a file written by :meth:`save`, on ``device``.

        Raises:
            RolloutError: The file is missing or unreadable (exit 3) or not a valid buffer file (exit 1).
        """
        from rolloutcli.hdf5.buffer_io import load_buffer_state

        state = load_buffer_state(Path(path))
        buffer = cls(state["max_length"], state["batch_size"], device, debug=debug)
        buffer.load_state_dict(state)
        return buffer

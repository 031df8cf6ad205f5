"""The streamed spill scatter: send rows whose global position is known to their shard and slot.

A shuffle that crosses the whole file (the feed-forward rows of ``batch``, the history windows of
``batch --history``) cannot be gathered shard by shard from a file larger than memory. Instead the source is
streamed once per pass, and every row read is *scattered*: a plan gives each row its position ``p`` in the
pass (``-1``: in no shard); position ``p`` lies in shard ``s`` with ``offsets[s] <= p < offsets[s + 1]`` at
slot ``p - offsets[s]``. :meth:`ShardScatter.add` sorts a block's rows by position and cuts them into one
piece per shard; pieces wait in memory, or in the shard's spill file ``.spill-<s>`` (in the output's
temporary folder) once the pending pieces exceed the budget. A shard is assembled (``index_copy_`` at its
slots) and handed to ``complete`` as soon as its last row arrived.

The result does not depend on the budget or on the blocks: every shard holds exactly its rows, in slot order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from rolloutcli.core.batching import gather_rows, scatter_rows
from rolloutcli.errors import EXIT_IO, RolloutError

Rows = dict[str, torch.Tensor]


class RowField(Protocol):
    """What the scatter needs to know of a field: its name and the dtype and shape of one row."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def row_shape(self) -> tuple[int, ...]: ...

    @property
    def row_bytes(self) -> int: ...


def aligned(nbytes: int) -> int:
    """Round up to 8 bytes, so every field of a spill chunk starts aligned for its dtype."""
    return (nbytes + 7) // 8 * 8


class Spill:
    """Rows of shards waiting for the rest of their rows: in memory, or appended to a spill file per shard.

    A spill chunk of k rows is ``slots [k] int64`` then, per field, its ``[k, *row_shape]`` bytes padded to
    8 bytes. Only the chunk sizes stay in memory.
    """

    def __init__(self, folder: Path, fields: Sequence[RowField], budget: int) -> None:
        self.folder, self.fields, self.budget = folder, list(fields), budget
        # Deleting a large file takes the file system a while: do it beside the work.
        self.cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-spill")
        self.pending: dict[int, list[tuple[torch.Tensor, Rows]]] = {}
        self.chunks: dict[int, list[int]] = {}
        self.pending_bytes = 0
        self.row_bytes = 8 + sum(f.row_bytes for f in self.fields)

    def path(self, shard: int) -> Path:
        """The spill file of ``shard``."""
        return self.folder / f".spill-{shard:06d}"

    def add(self, shard: int, slots: torch.Tensor, rows: Rows) -> None:
        """Keep ``rows {name: [k, ...]}`` destined for ``slots [k]`` of ``shard``."""
        self.pending.setdefault(shard, []).append((slots, rows))
        self.pending_bytes += slots.numel() * self.row_bytes

    def spill_if_needed(self) -> None:
        """Append every pending piece to its shard's spill file once they exceed the budget."""
        if self.pending_bytes <= self.budget:
            return
        for shard, pieces in self.pending.items():
            try:
                with open(self.path(shard), "ab") as handle:
                    for slots, rows in pieces:
                        handle.write(slots.numpy().data)
                        for f in self.fields:
                            data = rows[f.name].contiguous().view(-1).view(torch.uint8).numpy().data
                            handle.write(data)
                            handle.write(bytes(aligned(len(data)) - len(data)))
                        self.chunks.setdefault(shard, []).append(slots.numel())
            except OSError as exc:
                raise RolloutError(
                    f"{self.path(shard)}: cannot write temporary data: {exc.strerror or exc}. Free disk space.",
                    exit_code=EXIT_IO,
                ) from exc
        self.pending, self.pending_bytes = {}, 0

    def _read_chunks(self, shard: int, chunks: list[int]) -> list[tuple[torch.Tensor, Rows]]:
        pieces = []
        with open(self.path(shard), "rb") as handle:
            for count in chunks:
                widths = [aligned(count * f.row_bytes) for f in self.fields]
                raw = bytearray(8 * count + sum(widths))
                handle.readinto(raw)
                data = torch.frombuffer(raw, dtype=torch.uint8)
                offset, rows = 8 * count, {}
                for f, width in zip(self.fields, widths, strict=True):
                    part = data[offset : offset + count * f.row_bytes]
                    rows[f.name] = part.view(f.dtype).view(count, *f.row_shape)
                    offset += width
                pieces.append((data[: 8 * count].view(torch.int64), rows))
        self.cleaner.submit(self.path(shard).unlink)
        return pieces

    def close(self) -> None:
        """Wait for the spill files to be deleted."""
        self.cleaner.shutdown(wait=True)

    def assemble(self, shard: int, size: int, out: Rows) -> Rows:
        """The shard's rows in slot order, in ``out`` (``[size, ...]`` per field) unless they arrived in one
        piece; its spill file is read and deleted."""
        pieces = self.pending.pop(shard, [])
        self.pending_bytes -= sum(slots.numel() for slots, _ in pieces) * self.row_bytes
        chunks = self.chunks.pop(shard, [])
        if not chunks and len(pieces) == 1 and pieces[0][0].numel() == size:
            return pieces[0][1]  # one piece, sorted by position: already in slot order
        pieces = (self._read_chunks(shard, chunks) if chunks else []) + pieces
        for slots, rows in pieces:
            for f in self.fields:
                scatter_rows(out[f.name], slots, rows[f.name])
        return out


class ShardScatter:
    """One pass of the scatter: rows arrive in any order, shards leave complete, in slot order.

    Args:
        folder: where spill files go (the output's temporary folder).
        fields: the fields every row carries (``rows[f.name]`` is ``[k, *f.row_shape]`` of ``f.dtype``).
        sizes: rows of each shard of the pass; shard ``s`` takes positions ``offsets[s] .. offsets[s + 1] - 1``.
        budget: bytes of pending pieces kept in memory before they are spilled.
        buffers: ``buffers(size)`` lends ``{name: [size, *row_shape]}`` tensors to assemble a shard into.
        complete: ``complete(shard, rows)`` receives each shard once all its rows arrived (``rows`` may be a
            lent buffer: use it before asking for the next one).

    Use as a context manager (the spill files' deletion is awaited on exit); :meth:`finish` checks that
    every planned row arrived exactly once.
    """

    def __init__(
        self,
        folder: Path,
        fields: Sequence[RowField],
        sizes: Sequence[int],
        budget: int,
        *,
        buffers: Callable[[int], Rows],
        complete: Callable[[int, Rows], None],
    ) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self._offsets = torch.tensor(self.offsets, dtype=torch.int64)
        self.received = [0] * len(self.sizes)
        self.spill = Spill(folder, fields, max(budget, 1))
        self.buffers, self.complete = buffers, complete

    def __enter__(self) -> ShardScatter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.spill.close()

    def add(self, positions: torch.Tensor, rows: Rows, *, ordered: bool = False) -> None:
        """Route ``rows {name: [R, ...]}`` to positions ``[R]`` int64 (``-1``: the row is in no shard).

        ``ordered=True`` promises ascending positions, all ``>= 0`` (the rows are then cut without a copy).
        """
        if ordered:
            sorted_pos, gathered = positions, rows
        else:
            sorted_pos, order = torch.sort(positions)
            kept = int(torch.searchsorted(sorted_pos, 0))  # -1 (rows in no shard) sort first
            sorted_pos, order = sorted_pos[kept:], order[kept:]
            gathered = {name: gather_rows(value, order) for name, value in rows.items()}
        bounds = torch.searchsorted(sorted_pos, self._offsets).tolist()
        for shard, size in enumerate(self.sizes):
            lo, hi = bounds[shard], bounds[shard + 1]
            if lo == hi:
                continue
            slots = sorted_pos[lo:hi] - self.offsets[shard]
            self.spill.add(shard, slots, {name: value[lo:hi] for name, value in gathered.items()})
            self.received[shard] += hi - lo
            if self.received[shard] == size:
                self.complete(shard, self.spill.assemble(shard, size, self.buffers(size)))
        self.spill.spill_if_needed()

    def finish(self) -> None:
        """Check that every planned row arrived exactly once (an internal error otherwise)."""
        if self.received != self.sizes:
            raise AssertionError(f"scatter: shards received {self.received} rows, planned {self.sizes}")

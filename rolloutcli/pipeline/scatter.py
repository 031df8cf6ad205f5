"""The scatter: stream a pass's source blocks and send each item to its shard and slot.

The plan gives each item its position ``p`` in the pass (``-1``: in no shard); shard ``s`` holds positions
``offsets[s] <= p < offsets[s + 1]`` at slot ``p - offsets[s]``. Pieces of shards that span blocks wait in
memory, or in a spill file per shard once they exceed the budget. Every shard holds exactly its items, in
slot order, whatever the budget or the blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.batching import BatchPlan, scatter_rows
from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.shards import ShardWriter
from rolloutcli.pipeline.progress import Progress

Rows = dict[str, torch.Tensor]
Take = Callable[[torch.Tensor, "Rows | None"], Rows]  # (item indices in the block, buffers or None) -> rows


@dataclass(frozen=True)
class Field:
    """A source dataset and the row it contributes to shards.

    ``role`` is the source field's (schema); ``dtype`` as ``RolloutReader.tensor`` returns it; ``row_shape``
    as the export moves a row (``[layers, H]`` for hidden states, ``[K, *entry_shape]`` for a window).
    """

    source: str
    name: str
    role: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def hidden(self) -> bool:
        """``[T, layers, N, H]`` in the source; rows ``[layers, H]``."""
        return self.role == "hidden"

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.row_shape)


def aligned(nbytes: int) -> int:
    """Round up to 8 bytes, so every field of a spill chunk starts aligned for its dtype."""
    return (nbytes + 7) // 8 * 8


# What a pending group costs besides its rows, per tensor (the object and its allocation: ~500 bytes measured).
TENSOR_BYTES = 512


class Spill:
    """Rows of shards waiting for the rest of their rows: in memory, or appended to a spill file per shard.

    Rows wait as groups: a block's rows sorted by position, so each shard's are one run of them (a shard's slot
    is its position less its offset). One group a block, not one piece a shard: with many shards a block gives
    each a row or two, and a piece per shard (a gather and ~5 KB of tensors each) made ``batch`` of 10,000 small
    files into 1,600 shards spill after every block, 1,600 appends each (42 ms a file, against 13 into 16 shards:
    issue 39). A spill chunk of k rows is ``slots [k] int64`` then, per field, its ``[k, *row_shape]`` bytes
    padded to 8 bytes; each spill appends one chunk per shard that waits. Only the chunk sizes stay in memory.
    """

    def __init__(self, folder: Path, fields: Sequence[Field], budget: int, offsets: torch.Tensor) -> None:
        self.folder, self.fields, self.budget, self.offsets = folder, list(fields), budget, offsets
        self.groups: list[list[Any]] = []  # [positions, rows, shards waiting] each
        self.chunks: dict[int, list[int]] = {}
        # shards assembled (1 byte a shard): rows of theirs left in a group are not spilled
        self.done = bytearray(len(offsets) - 1)
        self.pending_bytes = 0
        self.row_bytes = 8 + sum(f.row_bytes for f in self.fields)
        self.group_bytes = TENSOR_BYTES * (1 + len(self.fields))

    def path(self, shard: int) -> Path:
        """The spill file of ``shard``."""
        return self.folder / f".spill-{shard:06d}"

    def add(self, positions: torch.Tensor, rows: Rows) -> None:
        """Keep ``rows {name: [k, ...]}`` at ``positions [k]`` (ascending, of shards not assembled yet); spill past
        the budget."""
        shards = torch.unique_consecutive(torch.searchsorted(self.offsets, positions, right=True)).numel()
        self.groups.append([positions, rows, shards])  # the shards with rows in it, not yet assembled
        self.pending_bytes += positions.numel() * self.row_bytes + self.group_bytes
        if self.pending_bytes > self.budget:
            self._spill()

    def _runs(self, shard: int) -> Iterator[tuple[torch.Tensor, Rows]]:
        """``shard``'s waiting rows, group by group: its slots and rows (views); a group none of whose shards
        waits any more is let go."""
        for group in list(self.groups):
            positions, rows, _ = group
            start, stop = torch.searchsorted(positions, self.offsets[shard : shard + 2]).tolist()
            if start == stop:
                continue
            yield positions[start:stop] - self.offsets[shard], {name: value[start:stop] for name, value in rows.items()}
            group[2] -= 1
            if group[2] == 0:
                self.groups = [g for g in self.groups if g is not group]
                self.pending_bytes -= positions.numel() * self.row_bytes + self.group_bytes

    def _spill(self) -> None:
        """Append each waiting shard's rows to its spill file, as one chunk: its run of each group, written where
        they lie (no copy of the groups)."""
        offsets = self.offsets.numpy()
        groups = [
            (
                positions.numpy(),
                [_as_bytes(rows[f.name], positions.numel(), f) for f in self.fields],
                np.searchsorted(positions.numpy(), offsets).tolist(),
            )
            for positions, rows, _ in self.groups
        ]
        for shard in range(len(offsets) - 1):
            runs = [(p, data, b[shard], b[shard + 1]) for p, data, b in groups if b[shard] < b[shard + 1]]
            if not runs or self.done[shard]:
                continue
            try:
                with open(self.path(shard), "ab") as handle:
                    for p, _, lo, hi in runs:
                        handle.write((p[lo:hi] - offsets[shard]).data)
                    for i in range(len(self.fields)):
                        size = sum(handle.write(data[i][lo:hi]) for _, data, lo, hi in runs)
                        handle.write(bytes(aligned(size) - size))
                self.chunks.setdefault(shard, []).append(sum(hi - lo for _, _, lo, hi in runs))
            except OSError as exc:
                raise RolloutError(
                    f"{self.path(shard)}: cannot write temporary data: {exc.strerror or exc}. Free disk space.",
                    exit_code=EXIT_IO,
                ) from exc
        self.groups, self.pending_bytes = [], 0

    def _read_chunks(self, shard: int, chunks: list[int]) -> Iterator[tuple[torch.Tensor, Rows]]:
        """The shard's spilled chunks one at a time (each valid until the next: never the whole shard twice in
        memory); the file is deleted after the last."""
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
                yield data[: 8 * count].view(torch.int64), rows
        self.path(shard).unlink()

    def assemble(self, shard: int, out: Rows) -> Rows:
        """The shard's rows in slot order, in ``out``; its spill file is read and deleted."""
        chunks = self.chunks.pop(shard, [])
        for slots, rows in itertools.chain(self._read_chunks(shard, chunks) if chunks else (), self._runs(shard)):
            for f in self.fields:
                scatter_rows(out[f.name], slots, rows[f.name])
        self.done[shard] = 1
        return out


def _as_bytes(value: torch.Tensor, count: int, f: Field) -> np.ndarray:
    """``count`` rows of field ``f`` as a ``[count, row_bytes]`` uint8 array (sharing memory where it can)."""
    return value.reshape(count, math.prod(f.row_shape)).contiguous().view(torch.uint8).numpy()


class ShardScatter:
    """One pass of the scatter: items arrive in any order, shards leave complete, in slot order.

    ``budget``: bytes of pending pieces kept in memory before they are spilled (to files in ``folder``).
    ``buffers(size, spanned)`` lends ``{name: [size, *row_shape]}`` tensors to assemble a shard into (``spanned``:
    from pieces of several blocks);
    ``complete(shard, rows)`` receives each shard once all its items arrived (use ``rows`` before the next).
    """

    def __init__(
        self,
        folder: Path,
        fields: Sequence[Field],
        sizes: Sequence[int],
        budget: int,
        *,
        buffers: Callable[[int, bool], Rows],
        complete: Callable[[int, Rows], None],
    ) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self._offsets = torch.tensor(self.offsets, dtype=torch.int64)
        self.received = [0] * len(self.sizes)
        self.spill = Spill(folder, fields, max(budget, 1), self._offsets)
        self.chunk = max(1, budget // 2 // max(self.spill.row_bytes, 1))
        self.buffers, self.complete = buffers, complete

    def add(self, positions: torch.Tensor | None, take: Take, *, order: torch.Tensor | None = None) -> None:
        """Route item ``i`` of a block to ``positions[i]``; ``take(index, out)`` gathers items of the block.

        ``order`` instead of ``positions``: the block holds every item of the pass, item ``order[p]`` at ``p``.
        """
        if order is None:
            assert positions is not None
            sorted_pos, order = torch.sort(positions)
            kept = int(torch.searchsorted(sorted_pos, 0))  # -1 (items in no shard) sort first
            sorted_pos, order = sorted_pos[kept:], order[kept:]
        else:
            sorted_pos = torch.arange(order.numel(), dtype=torch.int64)
        bounds = torch.searchsorted(sorted_pos, self._offsets).tolist()
        waiting, whole = [], torch.ones(sorted_pos.numel(), dtype=torch.bool)
        for shard, size in enumerate(self.sizes):
            lo, hi = bounds[shard], bounds[shard + 1]
            if lo == hi:
                continue
            self.received[shard] += hi - lo
            if hi - lo == size:  # the whole shard in this block, sorted: slots 0 .. size - 1
                self.complete(shard, take(order[lo:hi], self.buffers(size, False)))
                whole[lo:hi] = False
            else:
                waiting.append(shard)
        if not waiting:
            return
        if not bool(whole.all()):
            sorted_pos, order = sorted_pos[whole], order[whole]
        for start in range(0, sorted_pos.numel(), self.chunk):  # one gather a chunk of the block, every shard
            stop = min(sorted_pos.numel(), start + self.chunk)
            self.spill.add(sorted_pos[start:stop], take(order[start:stop], None))
        for shard in waiting:
            if self.received[shard] == self.sizes[shard]:
                self.complete(shard, self.spill.assemble(shard, self.buffers(self.sizes[shard], True)))

    def finish(self) -> None:
        """Check that every planned item arrived exactly once (an internal error otherwise)."""
        if self.received != self.sizes:
            raise AssertionError(f"scatter: shards received {self.received} rows, planned {self.sizes}")


class Emitter:
    """Hands shards to the writer (files named after the first epoch that uses them) and lends the reused
    buffer sets shards are gathered into: 2 (one written while the next is gathered) or 1 (streamed
    exports: the shard in flight is waited for first, to keep memory down). With 2, only a shard gathered from
    one block uses the second set (see :meth:`buffers`).
    """

    def __init__(
        self,
        plan: BatchPlan,
        writer: ShardWriter,
        fields: Sequence[Field],
        progress: Progress,
        shard_tensors: Callable[[int, int, Rows], Mapping[str, torch.Tensor]],
        *,
        buffer_sets: int = 2,
    ) -> None:
        self.plan, self.writer, self.fields, self.progress = plan, writer, fields, progress
        self.shard_tensors = shard_tensors
        self.largest = max(max(p.sizes) for p in plan.passes)
        self.buffer_sets = buffer_sets
        self._buffers: dict[int, Rows] = {}  # made when first lent
        self._lent = 0  # the set lent last (the shard in flight's, if any)

    def file_name(self, pass_index: int, shard: int) -> str:
        """``e<epoch>-b<mini-batch>.h5`` of the first epoch that uses the pass."""
        return f"e{self.plan.epoch_pass.index(pass_index):04d}-b{shard:05d}.h5"

    def buffers(self, size: int, spanned: bool = False) -> Rows:
        """``[size, *row_shape]`` views of the buffer set the next shard may use (reused: warm memory).

        A shard ``spanned`` over blocks (assembled from pieces kept or spilled) waits for the shard in flight and
        takes its set. Only a shard gathered from one block is filled while the one before is written. Shards
        of many files are all spanned, and with a fixed shard count they grow with the files: a second set
        held for them made ``batch -m 16`` of 10,000 small files keep 48 MB more (issue 39), and wait as long.
        """
        if spanned or self.buffer_sets == 1:
            self.writer.wait()
            index = self._lent  # every set is free: the warm one
        else:
            index = 1 - self._lent  # the shard in flight keeps its own
        if index not in self._buffers:
            self._buffers[index] = {f.name: torch.empty(self.largest, *f.row_shape, dtype=f.dtype) for f in self.fields}
        self._lent = index
        return {name: buffer[:size] for name, buffer in self._buffers[index].items()}

    def emit(self, pass_index: int, shard: int, rows: Rows) -> None:
        """Shape and submit one shard (``rows {name: [size, *row_shape]}`` in slot order)."""
        self.writer.submit(self.file_name(pass_index, shard), self.shard_tensors(pass_index, shard, rows))
        self.progress.advance()

    def entries(self) -> list[dict[str, Any]]:
        """The manifest's shard list, in epoch then mini-batch order: ``{file, epoch, mini_batch, rows, sha256}``."""
        out = []
        for epoch, pass_index in enumerate(self.plan.epoch_pass):
            for shard, size in enumerate(self.plan.passes[pass_index].sizes):
                name = self.file_name(pass_index, shard)
                entry = {"file": name, "epoch": epoch, "mini_batch": shard, "rows": size}
                out.append({**entry, "sha256": self.writer.results[name][1]})
        return out


class Gathered:
    """Small blocks of rows kept until they hold ``limit`` bytes, then scattered as one block (``ShardScatter.add``).

    A dataset of small files (one per training iteration) scattered file by file paid the scatter's per-call
    cost, a gather per shard and field, for each file: 31 of a 28 KB file's 34 ms (issue 39). The rows of a block
    are independent of the block (``take`` gathers by row: ``take(None, data, index, out)``), so the blocks'
    rows and source rows are joined in arrival order; where each row lands does not change. ``where`` maps source
    rows to their positions one by one (a shuffle order's network: ~0.9 ms for a small file's 64 rows, 1.4 for
    2,304), so it runs once on the join. A block larger than ``limit`` goes on its own, so memory holds at most
    twice ``limit`` more than before (the parts and their join).
    """

    def __init__(
        self, out: ShardScatter, take: Callable[..., Rows], limit: int, where: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.out, self.take, self.limit, self.where = out, take, limit, where
        self.parts: list[tuple[torch.Tensor, Rows]] = []
        self.bytes = 0

    def add(self, rows: torch.Tensor, data: Rows) -> None:
        """A block's source ``rows`` (int64, any shape) and its data."""
        size = sum(value.nbytes for value in data.values())
        if self.bytes + size > self.limit:
            self.flush()
        self.parts.append((rows.reshape(-1), data))
        self.bytes += size
        if self.bytes > self.limit:
            self.flush()

    def flush(self) -> None:
        """Scatter what is kept (at the end of a pass: before ``ShardScatter.finish``)."""
        if not self.parts:
            return
        if len(self.parts) == 1:
            rows, data = self.parts[0]
        else:
            rows = torch.cat([r for r, _ in self.parts])
            data = {name: torch.cat([d[name] for _, d in self.parts]) for name in self.parts[0][1]}
        self.parts, self.bytes = [], 0
        self.out.add(self.where(rows), lambda index, out: self.take(None, data, index, out))

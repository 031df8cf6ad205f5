"""CircularBuffer: Isaac Lab semantics against a list-of-deques model, AMP sampling, HDF5 persistence."""

from __future__ import annotations

import collections
import os

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rolloutcli.core.circular_buffer import CircularBuffer
from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import TEMP_MARKER

ENTRY = (2,)


# ---------------------------------------------------------------------------------------------- the model


class DequeModel:
    """The issue's semantics, written the obvious way: one deque of entries per environment."""

    def __init__(self, max_len: int, batch: int) -> None:
        self.max_len = max_len
        self.history = [collections.deque(maxlen=max_len) for _ in range(batch)]
        self.started = False  # something was appended at least once (the buffer exists)

    def append(self, data: torch.Tensor) -> None:
        self.started = True
        for env, queue in enumerate(self.history):
            queue.append(data[env].clone())

    def reset(self, envs: list[int]) -> None:
        for env in envs:
            self.history[env].clear()

    def read(self, keys: list[int]) -> torch.Tensor:
        rows = []
        for env, key in enumerate(keys):
            queue = self.history[env]
            rows.append(queue[-1 - min(key, len(queue) - 1)] if queue else torch.zeros(ENTRY))
        return torch.stack(rows)

    def full(self) -> torch.Tensor:
        """[batch, max_len, *ENTRY], oldest to newest, older slots holding the oldest stored entry."""
        out = []
        for queue in self.history:
            if not queue:
                out.append(torch.zeros(self.max_len, *ENTRY))
            else:
                out.append(torch.stack([queue[0]] * (self.max_len - len(queue)) + list(queue)))
        return torch.stack(out)

    def lengths(self) -> list[int]:
        return [len(q) for q in self.history]


class BufferMachine(RuleBasedStateMachine):
    """Random appends, resets (lists, slices, tensors, masks, None) and reads, compared with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = 0

    @initialize(max_len=st.integers(1, 5), batch=st.integers(1, 5))
    def setup(self, max_len: int, batch: int) -> None:
        self.buf = CircularBuffer(max_len, batch, "cpu")
        self.model = DequeModel(max_len, batch)
        self.batch = batch

    @rule()
    def append(self) -> None:
        # Distinct values per append and per env, so any misplaced entry shows.
        self.counter += 1
        base = torch.arange(self.batch, dtype=torch.float32).unsqueeze(1) * 1000 + self.counter
        data = base + torch.tensor([0.0, 0.5])
        self.buf.append(data)
        self.model.append(data)

    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        envs = list(range(self.batch))
        form = data.draw(st.sampled_from(["none", "list", "slice", "tensor", "mask"]))
        if form == "none":
            self.buf.reset()
            chosen = envs
        elif form == "list":
            chosen = data.draw(st.lists(st.sampled_from(envs), max_size=self.batch + 1))
            self.buf.reset(chosen)
        elif form == "slice":
            start = data.draw(st.integers(0, self.batch))
            stop = data.draw(st.integers(0, self.batch))
            step = data.draw(st.integers(1, 3))
            self.buf.reset(slice(start, stop, step))
            chosen = envs[start:stop:step]
        elif form == "tensor":
            chosen = data.draw(st.lists(st.sampled_from(envs), max_size=self.batch))
            self.buf.reset(torch.tensor(chosen, dtype=torch.long))
        else:
            flags = data.draw(st.lists(st.booleans(), min_size=self.batch, max_size=self.batch))
            self.buf.reset(torch.tensor(flags))
            chosen = [env for env, flag in enumerate(flags) if flag]
        self.model.reset(chosen)

    @precondition(lambda self: self.model.started)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.integers(0, 8), min_size=self.batch, max_size=self.batch))
        dtype = data.draw(st.sampled_from([torch.long, torch.int32, torch.uint8]))
        got = self.buf[torch.tensor(keys, dtype=dtype)]
        torch.testing.assert_close(got, self.model.read(keys), rtol=0, atol=0)

    @precondition(lambda self: self.model.started and any(self.model.lengths()))
    @rule(data=st.data())
    def sample(self, data: st.DataObject) -> None:
        fetch = data.draw(st.integers(1, self.model.max_len))
        window = data.draw(st.one_of(st.none(), st.integers(fetch, self.model.max_len + 2)))
        eligible = {
            (k, env): queue[-1 - k]
            for env, queue in enumerate(self.model.history)
            for k in range(min(window or fetch, len(queue)))
        }
        count = min(self.batch * fetch, len(eligible))
        minis = data.draw(st.integers(1, count))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        batches = list(
            self.buf.mini_batch_generator(fetch, minis, 2, generator=gen, window=window, return_indices=True)
        )
        assert len(batches) == 2 * minis
        for epoch in (batches[:minis], batches[minis:]):
            sizes = [len(b[0]) for b in epoch]
            assert sum(sizes) == count and max(sizes) - min(sizes) <= 1
            drawn = pairs_of(epoch)
            assert len(set(drawn)) == count and set(drawn) <= set(eligible)
        assert sorted(pairs_of(batches[:minis])) == sorted(pairs_of(batches[minis:]))  # drawn once per call
        for values, steps_back, env_ids in batches:
            expected = [eligible[(k, env)] for k, env in zip(steps_back.tolist(), env_ids.tolist(), strict=True)]
            torch.testing.assert_close(values, torch.stack(expected), rtol=0, atol=0)

    @precondition(lambda self: self.model.started)
    @rule()
    def save_state_and_continue_from_it(self) -> None:
        clone = CircularBuffer(self.buf.max_length, self.buf.batch_size, "cpu")
        clone.load_state_dict(self.buf.state_dict())
        self.buf = clone  # later rules run against the restored buffer (its fill state is "where")

    @invariant()
    def lengths_match(self) -> None:
        assert self.buf.current_length.tolist() == self.model.lengths()

    @invariant()
    def full_history_matches(self) -> None:
        if self.model.started:
            torch.testing.assert_close(self.buf.buffer, self.model.full(), rtol=0, atol=0)


BufferMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBufferAgainstModel = BufferMachine.TestCase


# ---------------------------------------------------------------------------------------------- semantics


def filled(max_len: int = 4, batch: int = 3, appends: int = 6) -> CircularBuffer:
    """A buffer whose entry for env b at append t (1-based) is [t, b]."""
    buf = CircularBuffer(max_len, batch, "cpu")
    for t in range(1, appends + 1):
        buf.append(torch.stack([torch.full((batch,), float(t)), torch.arange(batch, dtype=torch.float32)], 1))
    return buf


def test_isaac_lab_example_lifo_and_clamp():
    buf = filled(max_len=4, batch=3, appends=6)  # holds t = 3, 4, 5, 6
    got = buf[torch.tensor([0, 2, 99])][:, 0]
    assert got.tolist() == [6.0, 4.0, 3.0]
    assert buf.buffer[:, :, 0].tolist() == [[3.0, 4.0, 5.0, 6.0]] * 3
    assert buf.buffer.shape == (3, 4, 2)
    assert buf.current_length.tolist() == [4, 4, 4]


def test_first_append_after_reset_fills_history():
    buf = filled(max_len=3, batch=2, appends=5)
    buf.reset([1])
    assert buf.current_length.tolist() == [3, 0]
    assert buf[torch.tensor([0, 0])][1].tolist() == [0.0, 0.0]  # reset env reads zeros until appended
    buf.append(torch.tensor([[9.0, 0.0], [9.0, 1.0]]))
    assert buf.buffer[1, :, 0].tolist() == [9.0, 9.0, 9.0]
    assert buf.buffer[0, :, 0].tolist() == [4.0, 5.0, 9.0]
    assert buf[torch.tensor([2, 2])][:, 0].tolist() == [4.0, 9.0]


def test_properties():
    buf = CircularBuffer(5, 7, "cpu")
    assert (buf.batch_size, buf.max_length, buf.device) == (7, 5, "cpu")
    assert buf.current_length.tolist() == [0] * 7
    assert buf.entry_shape is None and buf.dtype is None
    buf.append(torch.zeros(7, 3, 2, dtype=torch.float16))
    assert buf.entry_shape == (3, 2) and buf.dtype == torch.float16
    assert "CircularBuffer(max_len=5" in repr(buf)


@pytest.mark.parametrize("appends", [4, 6])  # newest entry in the last storage slot, and elsewhere
def test_buffer_property_is_a_copy(appends):
    buf = filled(max_len=4, appends=appends)
    view = buf.buffer
    view.zero_()
    assert buf.buffer[:, :, 0].tolist() == [list(map(float, range(appends - 3, appends + 1)))] * 3


def test_errors_before_first_append():
    buf = CircularBuffer(3, 2, "cpu")
    with pytest.raises(RuntimeError, match="append"):
        buf[torch.tensor([0, 0])]
    with pytest.raises(RuntimeError, match="append"):
        _ = buf.buffer
    with pytest.raises(RuntimeError, match="append"):
        buf.mini_batch_generator(1, 1)
    buf.reset()  # allowed


@pytest.mark.parametrize(
    ("max_len", "batch", "error"),
    [(0, 2, ValueError), (2, 0, ValueError), (2.0, 2, TypeError), (True, 2, TypeError), (-1, 2, ValueError)],
)
def test_constructor_validation(max_len, batch, error):
    with pytest.raises(error):
        CircularBuffer(max_len, batch, "cpu")


def test_append_validation():
    buf = CircularBuffer(3, 2, "cpu")
    with pytest.raises(TypeError):
        buf.append([[1.0], [2.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch"):
        buf.append(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="batch"):
        buf.append(torch.tensor(1.0))
    buf.append(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="shape"):
        buf.append(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="dtype"):
        buf.append(torch.zeros(2, 4, dtype=torch.float64))
    assert buf.current_length.tolist() == [1, 1]  # failed appends changed nothing


def test_key_validation():
    buf = filled(batch=3)
    with pytest.raises(ValueError, match=">= 0"):
        buf[torch.tensor([0, -1, 0])]
    with pytest.raises(ValueError, match="shape"):
        buf[torch.tensor([0, 0])]
    with pytest.raises(ValueError, match="shape"):
        buf[torch.zeros(3, 1, dtype=torch.long)]
    with pytest.raises(TypeError):
        buf[torch.zeros(3)]
    with pytest.raises(TypeError):
        buf[torch.zeros(3, dtype=torch.bool)]
    with pytest.raises(TypeError):
        buf[[0, 0, 0]]  # type: ignore[index]


def test_negative_keys_on_device_checked_only_in_debug_mode():
    """On an accelerator a negative key is only validated with debug=True (meta stands in for the GPU)."""
    quiet = CircularBuffer(2, 3, "meta")
    quiet.append(torch.empty(3, 4, device="meta"))
    quiet[torch.full((3,), -1, device="meta")]  # not validated: would need a host sync
    loud = CircularBuffer(2, 3, "meta", debug=True)
    loud.append(torch.empty(3, 4, device="meta"))
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
        loud[torch.full((3,), -1, device="meta")]  # meta cannot be read on the host: proves it tried to


def test_hot_path_never_reads_device_values():
    """Meta tensors have no values: any .item()/bool()/tolist() inside append/getitem/reset would raise."""
    buf = CircularBuffer(4, 6, "meta")
    key = torch.zeros(6, dtype=torch.long, device="meta")
    for step in range(10):
        buf.append(torch.empty(6, 3, device="meta"))
        buf[key]
        buf.reset([step % 6])
        buf.reset(torch.tensor([1, 2], device="meta"))
        buf.reset(torch.zeros(6, dtype=torch.bool, device="meta"))
        buf.reset(slice(0, 2))
    buf.load_state_dict(
        {
            "max_length": 4,
            "batch_size": 6,
            "pointer": 0,
            "num_pushes": torch.zeros(6, dtype=torch.long),
            "data": torch.zeros(4, 6, 3),
        }
    )
    buf.append(torch.empty(6, 3, device="meta"))  # the torch.where fill path
    assert buf[key].shape == (6, 3)


def test_reset_forms_and_validation():
    buf = filled(max_len=3, batch=4)
    buf.reset(range(0, 4, 2))
    assert buf.current_length.tolist() == [0, 3, 0, 3]
    buf.reset([])  # no-op
    with pytest.raises(TypeError):
        buf.reset(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="mask"):
        buf.reset(torch.tensor([True, False]))


def test_reset_ids_tensor_reused_by_caller():
    """The caller may overwrite its env_ids tensor before the next append; the fill must use the old ids."""
    buf = filled(max_len=3, batch=3)
    ids = torch.tensor([1])
    buf.reset(ids)
    ids[0] = 2
    buf.append(torch.tensor([[7.0, 0.0], [7.0, 1.0], [7.0, 2.0]]))
    assert buf.buffer[1, :, 0].tolist() == [7.0, 7.0, 7.0]
    assert buf.buffer[2, :, 0].tolist() == [5.0, 6.0, 7.0]


def test_many_resets_between_appends_fall_back_to_where():
    buf = filled(max_len=2, batch=12)
    for env in range(11):
        buf.reset([env])
    buf.append(torch.full((12, 2), 8.0))
    assert buf.buffer[:11, :, 0].eq(8.0).all()
    assert buf.buffer[11, :, 0].tolist() == [6.0, 8.0]


# ---------------------------------------------------------------------------------------------- sampling


def pairs_of(batches):
    out = []
    for _, steps_back, env_ids in batches:
        out += list(zip(steps_back.tolist(), env_ids.tolist(), strict=True))
    return out


def test_generator_full_coverage_each_epoch_and_values():
    buf = filled(max_len=5, batch=4, appends=9)
    gen = torch.Generator().manual_seed(0)
    batches = list(buf.mini_batch_generator(3, 4, num_epochs=3, generator=gen, return_indices=True))
    assert len(batches) == 12
    assert all(b[0].shape == (3, 2) for b in batches)
    full = buf.buffer
    for data, steps_back, env_ids in batches:
        torch.testing.assert_close(data, full[env_ids, 4 - steps_back])
    expected = {(k, b) for k in range(3) for b in range(4)}
    epochs = [pairs_of(batches[i * 4 : (i + 1) * 4]) for i in range(3)]
    for epoch in epochs:
        assert len(epoch) == 12 and set(epoch) == expected  # every pair exactly once per epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # a fresh order every epoch


def test_generator_is_reproducible_with_a_seed():
    buf = filled(max_len=5, batch=4, appends=9)
    run = [
        list(buf.mini_batch_generator(2, 2, 2, generator=torch.Generator().manual_seed(7), return_indices=True))
        for _ in range(2)
    ]
    assert pairs_of(run[0]) == pairs_of(run[1])
    other = list(buf.mini_batch_generator(2, 2, 2, generator=torch.Generator().manual_seed(8), return_indices=True))
    assert pairs_of(other) != pairs_of(run[0])


def test_generator_respects_each_envs_history():
    buf = filled(max_len=6, batch=4, appends=8)
    buf.reset([1, 2])
    buf.append(torch.full((4, 2), 100.0))  # envs 1, 2 hold 1 entry
    buf.append(torch.full((4, 2), 101.0))  # ... now 2
    buf.reset([3])  # env 3 holds none
    gen = torch.Generator().manual_seed(1)
    batches = list(buf.mini_batch_generator(4, 3, num_epochs=2, generator=gen, return_indices=True))
    first = pairs_of(batches[:3])
    expected = {(k, 0) for k in range(4)} | {(k, b) for k in range(2) for b in (1, 2)}
    assert len(first) == 8 and set(first) == expected  # n = sum(min(F, current_length)) = 4 + 2 + 2 + 0
    assert [len(b[0]) for b in batches[:3]] == [3, 3, 2]  # remainder spread over the first mini-batches
    assert all(data[:, 0].ne(0).all() for data, _, _ in batches)  # never the zeroed history of env 3


def test_generator_window_draws_distinct_pairs_uniformly():
    buf = filled(max_len=4, batch=2, appends=4)  # 8 stored pairs
    gen = torch.Generator().manual_seed(3)
    counts = collections.Counter()
    trials = 600
    for _ in range(trials):
        drawn = pairs_of(buf.mini_batch_generator(1, 1, 1, generator=gen, window=4, return_indices=True))
        assert len(drawn) == 2 and len(set(drawn)) == 2  # batch * fetch_length distinct pairs
        counts.update(drawn)
    assert set(counts) == {(k, b) for k in range(4) for b in range(2)}
    expected = trials * 2 / 8
    assert all(abs(c - expected) < 5 * expected**0.5 for c in counts.values()), counts


def test_generator_snapshot_and_plain_output():
    buf = filled(max_len=3, batch=2, appends=3)
    it = buf.mini_batch_generator(3, 2, num_epochs=1, generator=torch.Generator().manual_seed(0))
    before = buf.buffer.reshape(-1, 2)
    buf.append(torch.full((2, 2), -5.0))  # after the draw: not seen
    batches = list(it)
    assert [b.shape for b in batches] == [(3, 2), (3, 2)]
    got = sorted(map(tuple, torch.cat(batches).tolist()))
    assert got == sorted(map(tuple, before.tolist()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fetch_length": 5, "num_mini_batches": 1}, "exceeds the history"),
        ({"fetch_length": 0, "num_mini_batches": 1}, "at least 1"),
        ({"fetch_length": 2, "num_mini_batches": 0}, "at least 1"),
        ({"fetch_length": 2, "num_mini_batches": 9}, "fewer than num_mini_batches"),
        ({"fetch_length": 2, "num_mini_batches": 1, "num_epochs": -1}, "num_epochs"),
        ({"fetch_length": 3, "num_mini_batches": 1, "window": 2}, "window"),
    ],
)
def test_generator_errors_are_raised_at_call_time(kwargs, match):
    buf = filled(max_len=4, batch=4, appends=4)
    with pytest.raises(ValueError, match=match):
        buf.mini_batch_generator(**kwargs)  # no next(): validation is eager


def test_generator_with_no_history():
    buf = filled(max_len=4, batch=2)
    buf.reset()
    with pytest.raises(ValueError, match="No history"):
        buf.mini_batch_generator(1, 1)


def test_generator_device_mismatch():
    buf = CircularBuffer(2, 2, "meta")
    buf.append(torch.empty(2, 1, device="meta"))
    with pytest.raises(ValueError, match="generator"):
        buf.mini_batch_generator(1, 1, generator=torch.Generator())


# ---------------------------------------------------------------------------------------------- persistence


def assert_same_state(a: CircularBuffer, b: CircularBuffer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert {k: sa[k] for k in ("max_length", "batch_size", "pointer")} == {
        k: sb[k] for k in ("max_length", "batch_size", "pointer")
    }
    assert torch.equal(sa["num_pushes"], sb["num_pushes"])
    assert (sa["data"] is None) == (sb["data"] is None)
    if sa["data"] is not None:
        assert sa["data"].dtype == sb["data"].dtype
        assert torch.equal(sa["data"], sb["data"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.float64])
def test_save_load_round_trip_then_continue(tmp_path, dtype):
    buf = CircularBuffer(4, 3, "cpu")
    for t in range(6):
        buf.append((torch.arange(6).view(3, 2) + t).to(dtype))
    buf.reset([1])
    buf.append((torch.arange(6).view(3, 2) * 3).to(dtype))
    buf.reset([2])  # saved with env 2 reset and not yet refilled
    path = tmp_path / "replay.h5"
    buf.save(path)
    back = CircularBuffer.load(path)
    assert_same_state(buf, back)
    nxt = (torch.ones(3, 2) * 9).to(dtype)
    buf.append(nxt)
    back.append(nxt)
    assert_same_state(buf, back)
    key = torch.tensor([0, 3, 1])
    assert torch.equal(buf[key], back[key])
    assert list(tmp_path.iterdir()) == [path]  # no temporaries left


def test_save_load_before_first_append(tmp_path):
    buf = CircularBuffer(2, 3, "cpu")
    buf.save(tmp_path / "empty.h5")
    back = CircularBuffer.load(tmp_path / "empty.h5")
    assert_same_state(buf, back)
    back.append(torch.ones(3, 1))
    assert back.buffer.eq(1).all()


def test_save_refuses_to_overwrite(tmp_path):
    path = tmp_path / "replay.h5"
    filled().save(path)
    with pytest.raises(RolloutError) as err:
        filled(appends=2).save(path)
    assert err.value.exit_code == EXIT_USAGE
    assert CircularBuffer.load(path).state_dict()["num_pushes"].tolist() == [6, 6, 6]
    filled(appends=2).save(path, overwrite=True)
    assert CircularBuffer.load(path).state_dict()["num_pushes"].tolist() == [2, 2, 2]


def test_interrupted_save_leaves_old_file(tmp_path, monkeypatch):
    import rolloutcli.hdf5.buffer_io as buffer_io

    path = tmp_path / "replay.h5"
    filled().save(path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(buffer_io, "_to_numpy", boom)
    with pytest.raises(KeyboardInterrupt):
        filled(appends=2).save(path, overwrite=True)
    assert path.read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if TEMP_MARKER in p]


def write_valid(path):
    filled().save(path)


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda f: f.attrs.__setitem__("format", "something.else"), "format"),
        (lambda f: f.attrs.__setitem__("format_version", 99), "format_version"),
        (lambda f: f.attrs.__delitem__("max_length"), "max_length"),
        (lambda f: f.attrs.__setitem__("batch_size", 0), "batch_size"),
        (lambda f: f.attrs.__setitem__("pointer", 17), "pointer"),
        (lambda f: f.attrs.__setitem__("pointer", "x"), "pointer"),
        (lambda f: (f.__delitem__("num_pushes"), f.create_dataset("num_pushes", data=[1, 2])), "num_pushes"),
        (lambda f: (f.__delitem__("num_pushes"), f.create_dataset("num_pushes", data=[-1, 2, 2])), "num_pushes"),
        (lambda f: f.__delitem__("num_pushes"), "num_pushes"),
        (lambda f: f.__delitem__("data"), "data"),
        (lambda f: (f.__delitem__("data"), f.create_dataset("data", data=np.zeros((4, 2, 2)))), "data"),
        (lambda f: f["data"].attrs.__setitem__("torch_dtype", "notatype"), "torch_dtype"),
        (lambda f: f["data"].attrs.__setitem__("torch_dtype", "int64"), "dtype int64"),
    ],
)
def test_load_rejects_bad_files(tmp_path, corrupt, match):
    path = tmp_path / "bad.h5"
    write_valid(path)
    with h5py.File(path, "r+") as handle:
        corrupt(handle)
    with pytest.raises(RolloutError, match=match) as err:
        CircularBuffer.load(path)
    assert err.value.exit_code == EXIT_BAD_DATA
    assert str(path) in str(err.value)


def test_load_reports_several_problems_at_once(tmp_path):
    path = tmp_path / "bad.h5"
    write_valid(path)
    with h5py.File(path, "r+") as handle:
        handle.attrs["pointer"] = 40
        del handle["num_pushes"]
    with pytest.raises(RolloutError) as err:
        CircularBuffer.load(path)
    assert len(err.value.problems) == 2


def test_load_missing_and_non_hdf5_files(tmp_path):
    with pytest.raises(RolloutError, match="no such file") as err:
        CircularBuffer.load(tmp_path / "nope.h5")
    assert err.value.exit_code == EXIT_IO
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    with pytest.raises(RolloutError, match="HDF5") as err:
        CircularBuffer.load(text)
    assert err.value.exit_code == EXIT_BAD_DATA


def test_load_state_dict_validation():
    buf = filled(max_len=4, batch=3)
    good = buf.state_dict()
    other = CircularBuffer(4, 2, "cpu")
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(good)
    for key, value, error in [
        ("pointer", 4, ValueError),
        ("num_pushes", torch.tensor([1, -1, 0]), ValueError),
        ("num_pushes", torch.zeros(3), TypeError),
        ("num_pushes", torch.zeros(2, dtype=torch.long), ValueError),
        ("data", torch.zeros(3, 3, 2), ValueError),
        ("data", None, ValueError),
        ("data", np.zeros((4, 3, 2)), TypeError),
    ]:
        with pytest.raises(error):
            CircularBuffer(4, 3, "cpu").load_state_dict({**good, key: value})
    with pytest.raises(ValueError, match="missing"):
        CircularBuffer(4, 3, "cpu").load_state_dict({"pointer": 0})


def test_state_dict_is_a_snapshot():
    buf = filled()
    state = buf.state_dict()
    buf.append(torch.zeros(3, 2))
    assert state["num_pushes"].tolist() == [6, 6, 6]
    assert state["data"].abs().sum() > 0


def test_core_module_does_not_import_h5py():
    import ast
    import inspect

    import rolloutcli.core.circular_buffer as module

    tree = ast.parse(inspect.getsource(module))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "h5py" not in imported

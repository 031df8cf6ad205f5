"""The stateless order (rolloutcli.core.order): a bijection of range(n), a pure function of (key, n, positions)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.core.batching import feedforward_plan
from rolloutcli.core.order import ALGORITHM, ORDER_VERSION, RowOrder, draw_key

PRIMES = [2, 3, 5, 7, 11, 13, 97, 101, 1009, 65537]


def test_permutation_for_small_prime_and_power_of_two_sizes() -> None:
    for n in [1, 4, 16, 17, 255, 256, 257, 1000, 4095, 4096, 4097, *PRIMES]:
        for key in (0, 1, 2**61 + 3):
            rows = RowOrder(key, n).rows()
            assert torch.equal(torch.sort(rows).values, torch.arange(n)), (key, n)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**62 - 1), st.integers(1, 5000), st.data())
def test_chunks_agree_with_the_whole_and_inverse(key: int, n: int, data) -> None:
    order = RowOrder(key, n)
    whole = order.rows()
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, n))
    assert torch.equal(order.rows(start, stop), whole[start:stop])
    assert torch.equal(order.positions(whole), torch.arange(n))
    rows = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=20)), dtype=torch.int64)
    assert torch.equal(whole[order.positions(rows)], rows)


def test_deterministic_keyed_and_recorded() -> None:
    a, b = RowOrder(7, 10_000).rows(), RowOrder(7, 10_000).rows()
    assert torch.equal(a, b) and not torch.equal(a, RowOrder(8, 10_000).rows())
    assert not torch.equal(a, torch.arange(10_000))
    # pinned: any change of the network changes every shard and must bump ORDER_VERSION
    assert RowOrder(5, 20).rows().tolist() == [5, 17, 18, 6, 8, 9, 7, 16, 2, 1, 15, 12, 13, 10, 14, 0, 4, 19, 11, 3]
    record = {"algorithm": ALGORITHM, "version": ORDER_VERSION, "rounds": 6, "key": 5, "n": 20}
    assert RowOrder(5, 20).record() == record
    assert ORDER_VERSION == 2


def test_positions_reject_rows_outside_the_range() -> None:
    try:
        RowOrder(1, 5).positions(torch.tensor([5]))
    except ValueError as exc:
        assert "[0, 5)" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_feedforward_plan_streams_the_keyed_order() -> None:
    plan = feedforward_plan(10, 7, 3, 2, parity=False, generator=torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(4)
    for p in plan.passes:
        assert p.rows is None  # no per-row array is held
        order = RowOrder(draw_key(generator), 70)
        assert p.order == order
        assert torch.equal(torch.cat([p.rows_of(s) for s in range(3)]), order.rows())
        assert torch.equal(p.positions_of(torch.arange(70)), order.positions(torch.arange(70)))


def test_huge_ranges_need_no_per_row_state() -> None:
    order = RowOrder(3, 10**12)  # a randperm of it would need 8 TB
    rows = order.rows(10**12 - 1000, 10**12)
    assert rows.numel() == 1000 and int(rows.min()) >= 0 and int(rows.max()) < 10**12
    assert torch.equal(order.positions(rows), torch.arange(10**12 - 1000, 10**12))

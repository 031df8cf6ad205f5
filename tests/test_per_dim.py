"""Per-dimension statistics: exact against numpy, block-independent, non-finite values counted, not averaged."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.core.per_dim import DimMoments


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31 - 1), st.integers(1, 39))
def test_exact_and_independent_of_blocks(rows, dims, seed, cut):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, dims)) * 10.0 ** rng.integers(-3, 4, dims)).astype(np.float32)
    whole = DimMoments.of(values)
    cut = min(cut, rows)
    merged = DimMoments.of(values[:cut]).merge(DimMoments.of(values[cut:]))
    assert whole == merged
    stats = whole.as_dict()
    exact = values.astype(np.float64)
    np.testing.assert_allclose(stats["mean"], exact.mean(0), rtol=1e-12, atol=0)
    np.testing.assert_array_equal(stats["min"], exact.min(0))
    np.testing.assert_array_equal(stats["max"], exact.max(0))
    if rows > 1:
        np.testing.assert_allclose(stats["std"], exact.std(0, ddof=1), rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(whole.population_variance(), exact.var(0), rtol=1e-9, atol=1e-300)


def test_non_finite_values_are_counted_not_averaged():
    values = np.array([[1.0, np.nan], [3.0, 2.0], [np.inf, 4.0], [5.0, -np.inf]], np.float32)
    stats = DimMoments.of(values).as_dict()
    assert stats["nonfinite"] == [1, 2] and stats["count"] == [3, 2]
    assert stats["mean"] == [3.0, 3.0] and stats["min"] == [1.0, 2.0] and stats["max"] == [5.0, 4.0]
    empty = DimMoments.of(np.full((2, 1), np.nan, np.float32)).as_dict()
    assert empty["mean"] == [None] and empty["nonfinite"] == [2]


def test_pieces_of_a_large_block_merge_exactly(monkeypatch):
    from rolloutcli.core import per_dim

    values = np.random.default_rng(0).standard_normal((1000, 3)).astype(np.float32)
    whole = DimMoments.of(values)
    monkeypatch.setattr(per_dim, "CHUNK", 64)
    assert DimMoments.of(values) == whole


def test_small_integers_take_the_integer_path_with_the_same_result():
    values = np.random.default_rng(2).integers(0, 256, (500, 7)).astype(np.uint8)
    fast = DimMoments.of(values)
    assert fast == DimMoments.of(values.astype(np.float32))
    stats = fast.as_dict()
    np.testing.assert_allclose(stats["mean"], values.astype(np.float64).mean(0), rtol=1e-15)
    np.testing.assert_allclose(stats["std"], values.astype(np.float64).std(0, ddof=1), rtol=1e-12)

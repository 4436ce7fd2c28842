"""A strided page's runs of bytes are exactly the bytes its elements occupy, whatever the
order of its dimensions; overlapping pages are refused."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvflow.errors import ConfigError
from kvflow.layout.pages import PageRuns, StridedPages, page_runs


def element_bytes(shape: list[int], strides: list[int], itemsize: int) -> list[int]:
    """Every byte of every element, one by one (the reference)."""
    return sorted(
        sum(i * s for i, s in zip(index, strides, strict=True)) * itemsize + byte
        for index in itertools.product(*(range(n) for n in shape))
        for byte in range(itemsize)
    )


@st.composite
def strided_pages(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """A dense page in any dimension order, some dimensions padded (as a layout that keeps
    heads outside blocks leaves gaps inside a block's page)."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    order = draw(st.permutations(range(len(shape))))  # innermost first
    strides = [0] * len(shape)
    extent = 1
    for dim in order:
        strides[dim] = extent
        extent *= shape[dim] + draw(st.sampled_from([0, 0, 1, 3]))
    return shape, strides, draw(st.sampled_from([1, 2, 4]))


@given(strided_pages())
def test_runs_cover_exactly_the_bytes_of_the_elements(page: tuple[list[int], list[int], int]) -> None:
    shape, strides, itemsize = page
    runs = page_runs(shape, strides, itemsize)
    covered = [offset + byte for offset in runs.offsets for byte in range(runs.run_bytes)]
    assert covered == element_bytes(shape, strides, itemsize)
    assert list(runs.offsets) == sorted(runs.offsets) and runs.run_bytes % itemsize == 0


def test_a_dense_page_is_one_run_whatever_its_inner_order() -> None:
    # vLLM's [heads, tokens, K+V] page of 4 heads, 32 tokens, 128 fp16 values: HNC and NHC
    assert page_runs([4, 32, 128], [32 * 128, 128, 1], 2) == PageRuns(32768, (0,))
    assert page_runs([4, 32, 128], [128, 4 * 128, 1], 2) == PageRuns(32768, (0,))


def test_heads_outside_the_blocks_make_one_run_per_head() -> None:
    # LHBNC with 64 blocks: a head's tokens of one block are 8 KiB, heads 64 blocks apart
    runs = page_runs([4, 32, 128], [64 * 32 * 128, 128, 1], 2)
    assert runs == PageRuns(8192, (0, 64 * 8192, 128 * 8192, 192 * 8192))


@pytest.mark.parametrize(
    ("shape", "strides", "why"),
    [([4, 8], [0, 1], "share bytes"), ([2, 8], [4, 1], "share bytes"), ([0, 8], [8, 1], "positive")],
)
def test_pages_whose_elements_share_bytes_are_refused(shape: list[int], strides: list[int], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        page_runs(shape, strides, 2)


@given(
    offsets=st.lists(st.integers(0, 64), min_size=1, max_size=4, unique=True),
    run=st.integers(1, 8),
    stride=st.integers(0, 40),  # 0: a cache of one block may say any stride
    blocks=st.integers(1, 6),
)
def test_block_arrays_are_refused_exactly_when_two_runs_share_a_byte(
    offsets: list[int], run: int, stride: int, blocks: int
) -> None:
    runs = PageRuns(run, tuple(sorted(offsets)))
    spans = [(b * stride + o, b * stride + o + run) for b in range(blocks) for o in runs.offsets]
    shared = any(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(spans, 2))
    pages = StridedPages(region=0, offset=100, block_stride=stride, runs=runs)
    if shared:
        with pytest.raises(ConfigError):
            pages.block_arrays(layer=3, num_blocks=blocks)
        return
    arrays = pages.block_arrays(layer=3, num_blocks=blocks)
    assert [(a.offset, a.stride, a.layer) for a in arrays] == [(100 + o, stride, 3) for o in runs.offsets]

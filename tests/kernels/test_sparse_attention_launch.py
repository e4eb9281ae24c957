"""The launch shapes of kernels/sparse_attention.py (pure host arithmetic, no GPU): decode splits
the selected rows over 16-head blocks, a few queries into fewer splits; prefill gathers each row once for a whole block of heads
while the queries still fill the GPU, and never pads heads beyond the next multiple of 16."""

import pytest

from kernels.sparse_attention import DEFAULT_TILE, FEW_QUERIES, TILE_PARAMS, launch_shape

H200 = (9, 0)


def test_decode_splits_sixteen_head_blocks():
    p = TILE_PARAMS[H200]
    assert launch_shape(1, 64, H200) == (p["splits"], 16, p["threads"], p["decode_block_i"])


@pytest.mark.parametrize("queries,nsplit", [(2, 4), (4, 4), (8, 4), (16, 4), (32, 2)])
def test_a_few_queries_split_less_than_one(queries, nsplit):
    # a chunk step's queries: the launch stays within few_query_ctas CTAs, so the partial outputs
    # the combine reads back shrink (S x splits x H x D fp32), while every split still has rows;
    # 2..16 queries split alike (a chunk step's 16 slots and an eager call of its real tokens)
    p = TILE_PARAMS[H200]
    assert launch_shape(queries, 64, H200) == (nsplit, 16, p["threads"], p["decode_block_i"])
    assert max(queries, FEW_QUERIES) * 4 * nsplit <= p["few_query_ctas"]


@pytest.mark.parametrize("queries", [132, 728, 2048])
def test_prefill_takes_every_head_in_one_block(queries):
    assert launch_shape(queries, 64, H200) == (1, 64, 256, 0)


def test_prefill_too_short_for_whole_blocks_keeps_sixteen_heads():
    # 40 queries x 4 blocks of 16 heads fill 160 CTAs; 40 CTAs of 64 heads would not
    assert launch_shape(40, 64, H200) == (1, 16, 128, 0)


def test_small_models_never_pad_heads_past_sixteen():
    assert launch_shape(512, 4, H200)[1] == 16
    assert launch_shape(512, 24, H200)[1] == 32


def test_unknown_architectures_use_the_default_tiles():
    assert launch_shape(2048, 64, (8, 6)) == (1, DEFAULT_TILE["block_h"], DEFAULT_TILE["threads"], 0)


def test_the_few_queries_that_split_alike_are_a_chunk_steps_slots():
    from engine.chunk_position import CHUNK_SLOTS
    assert FEW_QUERIES == CHUNK_SLOTS

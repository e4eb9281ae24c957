"""ExpertArena's slot table (engine/experts/arena.py): writes are noted on the host and applied
together, and whoever reads `table` sees every write made so far."""

from __future__ import annotations

import torch

from engine.config import ModelArgs
from engine.experts.arena import ExpertArena
from engine.pack import RecordLayout


def small_arena() -> ExpertArena:
    args = ModelArgs(dim=64, moe_inter_dim=32)
    return ExpertArena(4, RecordLayout.from_args(args), units=3, experts=5)


def test_the_table_shows_every_write_and_the_last_write_of_a_key_wins():
    arena = small_arena()
    assert torch.equal(arena.table, torch.full((3, 5), -1, dtype=torch.int32))
    arena.assign(0, 1, 2)
    arena.assign(2, 4, 3)
    arena.clear(0, 1)  # evicted again before anything read the table
    arena.assign(0, 1, 1)  # and admitted to another slot
    arena.assign(1, 0, 0)
    want = torch.full((3, 5), -1, dtype=torch.int32)
    want[0, 1], want[2, 4], want[1, 0] = 1, 3, 0
    assert torch.equal(arena.table, want)
    arena.clear(2, 4)
    arena.sync_table()
    want[2, 4] = -1
    assert torch.equal(arena.table, want) and arena.table.dtype == torch.int32


def test_a_sync_with_nothing_noted_changes_nothing():
    arena = small_arena()
    arena.assign(1, 3, 2)
    arena.sync_table()
    before = arena.table.clone()
    arena.sync_table()
    assert torch.equal(arena.table, before) and int(arena.table[1, 3]) == 2

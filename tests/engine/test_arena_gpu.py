"""ExpertArena's slot table on a CUDA device (engine/experts/arena.py): a sync sends the table as
it is at the sync, so a write made afterwards never reaches work enqueued before it, also when
the syncs go round the ring of pinned buffers while the device is busy."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelArgs
from engine.experts.arena import ExpertArena
from engine.pack import RecordLayout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _arena() -> ExpertArena:
    return ExpertArena(4, RecordLayout.from_args(ModelArgs(dim=64, moe_inter_dim=32)), units=3, experts=5,
                       device="cuda")


def test_the_device_has_an_index_and_the_table_lives_there():
    arena = _arena()
    assert arena.device.index is not None and arena.table.device == arena.device


def test_work_enqueued_after_a_sync_sees_the_table_of_that_sync_not_later_writes():
    arena = _arena()
    seen = []
    torch.cuda._sleep(200_000_000)  # the device is busy: every copy below waits behind this
    for slot in range(20):  # more syncs than the ring has buffers
        arena.assign(1, 2, slot % 4)
        arena.assign(0, slot % 5, slot % 4)
        seen.append(arena.table.clone())  # enqueued after this sync's copy
    arena.clear(1, 2)
    torch.cuda.synchronize()
    for slot, table in enumerate(seen):
        assert int(table[1, 2]) == slot % 4
        assert int(table[0, slot % 5]) == slot % 4
    assert int(arena.table[1, 2]) == -1

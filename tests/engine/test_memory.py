"""Memory budget accounting: /proc parsing, weight bytes counted at load, parts that add up to the total."""

from __future__ import annotations

import pytest
import torch

from engine.memory import MemInfo, PART_NAMES, memory_budget, process_rss, read_meminfo
from engine.weights import CountedWeights

GiB = 2**30

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1024000 kB
MemAvailable:    8192000 kB
Buffers:          100000 kB
Cached:          6000000 kB
SwapCached:            0 kB
"""


def parts_sum(budget) -> int:
    return sum(size for _, size in budget.parts)


def test_read_meminfo_and_rss(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text(MEMINFO)
    info = read_meminfo(f)
    assert info == MemInfo(total=16384000 * 1024, available=8192000 * 1024, cached=6000000 * 1024)
    real = read_meminfo()
    assert 0 < real.available <= real.total
    assert process_rss() > 0
    bad = tmp_path / "empty"
    bad.write_text("nothing here\n")
    with pytest.raises(RuntimeError, match="MemTotal"):
        read_meminfo(bad)


def test_unified_budget_parts_add_up_and_free_is_mem_available():
    info = MemInfo(total=16 * GiB, available=8 * GiB, cached=5 * GiB)
    b = memory_budget("cpu", weights=2 * GiB, expert_cache=GiB, state=GiB // 4, workspace=GiB // 4,
                      meminfo=info, rss=5 * GiB)
    assert b.unified and b.total == 16 * GiB and b.page_cache == 5 * GiB
    assert [name for name, _ in b.parts] == list(PART_NAMES)
    assert parts_sum(b) == b.total
    assert b.part("resident weights") == 2 * GiB and b.part("expert cache") == GiB
    assert b.part("session state") == GiB // 4 and b.part("workspace") == GiB // 4
    assert b.part("framework") == 5 * GiB - (3 * GiB + GiB // 2)  # RSS beyond what we account for
    assert b.part("free") == 8 * GiB
    assert b.part("other") == 16 * GiB - 5 * GiB - 8 * GiB


def test_unified_budget_free_is_capped_by_what_is_left():
    # mmapped weights count as page cache, so MemAvailable can exceed total - our parts
    info = MemInfo(total=16 * GiB, available=15 * GiB, cached=12 * GiB)
    b = memory_budget("cpu", weights=10 * GiB, expert_cache=0, state=0, workspace=0, meminfo=info, rss=GiB)
    assert parts_sum(b) == b.total and b.part("free") == 6 * GiB and b.part("other") == 0
    assert all(size >= 0 for _, size in b.parts)


def test_unified_budget_still_adds_up_when_our_parts_exceed_the_pool():
    info = MemInfo(total=16 * GiB, available=GiB, cached=0)
    b = memory_budget("cpu", weights=20 * GiB, expert_cache=4 * GiB, state=0, workspace=0, meminfo=info, rss=0)
    assert parts_sum(b) == b.total == 16 * GiB
    assert b.part("free") == 0 and all(size >= 0 for _, size in b.parts)
    assert b.part("resident weights") == pytest.approx(16 * GiB * 20 / 24, abs=1)


def test_counted_weights_sum_the_bytes_of_each_name_read_once():
    a = torch.zeros(100, dtype=torch.float32)  # 400 bytes
    b = torch.zeros(10, dtype=torch.bfloat16)  # 20 bytes
    big = torch.zeros(1000)
    tensors = {"a": a, "b": b, "view": big[:10]}
    get = CountedWeights(lambda name: tensors[name].clone() if name == "b" else tensors[name])
    assert get.nbytes == 0
    assert get("a") is a and get.nbytes == 400
    get("b"), get("b"), get("a")  # a name read again (even as a fresh copy) counts once
    assert get.nbytes == 420
    get("view")
    assert get.nbytes == 460  # a view counts its own bytes, not its storage's


@pytest.mark.gpu
def test_discrete_gpu_budget_adds_up():
    weights = torch.zeros(2**20, device="cuda")  # 4 MiB
    b = memory_budget("cuda", weights=weights.nbytes, expert_cache=0, state=0, workspace=0)
    free, total = torch.cuda.mem_get_info()
    assert parts_sum(b) == b.total == total
    assert b.part("resident weights") == weights.nbytes

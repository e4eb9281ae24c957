"""bench/tier_replay.py: the GPU cache and the host tier replayed together, on uniform routing
(the synthetic checkpoints') and on a shipped DeepSeek-V4-Flash trace, with the figures that
chose the engine's tier behaviour (`HostTier.refresh`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import tier_replay
from bench.cache_replay import ReplayError, read_route_csv, route_calls

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.fixture(scope="module")
def uniform():
    """43 layers x 24 experts, 120 tokens: the full-depth bench's pack, 50 % on the GPU."""
    return route_calls(tier_replay.uniform_rows(43, 24, 120)), 120


def test_a_tier_of_what_the_gpu_cannot_hold_misses_often_and_refresh_helps(uniform):
    calls, tokens = uniform
    gpu, rest = 516, 1032 - 516
    inclusive = tier_replay.replay(calls, tokens, gpu, rest, "inclusive")[-1]
    refresh = tier_replay.replay(calls, tokens, gpu, rest, "refresh")[-1]
    whole = tier_replay.replay(calls, tokens, gpu, 1032, "inclusive")[-1]
    assert 0.47 < inclusive.device_hits / inclusive.uses < 0.52  # uniform routing: the share cached
    # the tier is inclusive: sized to the rest, about half the GPU's misses fall past it
    assert 0.45 < inclusive.ram_share < 0.60 and refresh.ram_share > inclusive.ram_share + 0.04
    assert whole.ram_share == 1.0 and whole.disk_reads == 0  # a tier of the whole pool serves every miss
    assert refresh.device_hits == inclusive.device_hits == whole.device_hits  # the tier never changes the GPU's


@pytest.mark.skipif(not (TRACES / "route_W50.csv").is_file(), reason="the shared traces are not here")
def test_on_a_real_trace_refresh_and_demotion_never_lose_to_the_tier_alone():
    rows = read_route_csv(TRACES / "route_W50.csv")
    calls, tokens = route_calls(rows), len({r[0] for r in rows})
    for gpu, tier in ((256, 256), (512, 384), (1024, 512)):
        got = {mode: tier_replay.replay(calls, tokens, gpu, tier, mode, passes=2)[-1] for mode in tier_replay.MODES}
        assert got["refresh"].disk_reads <= got["inclusive"].disk_reads
        assert got["demote"].disk_reads <= got["refresh"].disk_reads
        assert got["inclusive"].device_hits == got["refresh"].device_hits == got["demote"].device_hits
    assert got["demote"].demotions > 0


def test_bad_sizes_and_modes_are_refused_with_the_reason():
    with pytest.raises(ReplayError, match="not a whole number"):
        tier_replay.parse_slots("12,lots", rest=10)
    assert tier_replay.parse_slots("rest,7", rest=10) == [10, 7]
    with pytest.raises(ReplayError, match="unknown tier mode"):
        tier_replay.TwoTiers(4, 4, "exclusive", "lru", 2, 4)
    assert tier_replay.main(["--uniform", "--layers", "2", "--experts", "8", "--tokens", "5",
                             "--device-slots", "4", "--tier-slots", "rest"]) == 0
    assert tier_replay.main([]) == 2

"""Replay routing traces through the two expert tiers: the GPU cache and the host-RAM tier behind it.

    python bench/tier_replay.py ../shared/traces/route_W130.csv
    python bench/tier_replay.py TRACE.csv --device-slots 1024,2560 --tier-slots rest,1927 --passes 3
    python bench/tier_replay.py --uniform --layers 43 --experts 24 --device-slots 516 --tier-slots rest

Each route CSV row is one engine call (one layer of one token), replayed as `StreamingExperts`
serves it (bench/cache_replay.py `serve_calls`): the GPU cache looks every expert up, and each
miss is served by the host tier when the tier holds the record (a RAM hit: one host->device
copy), else read from the disk. The tier, like `engine.experts.host_tier.HostTier`,
admits every record read from the disk (inclusive). Both tiers use `--policy` (the engine gives
the tier the cache's policy). Tier modes:

- `inclusive`: the tier alone (no word from the GPU cache);
- `refresh` (the engine's, `HostTier.refresh`): a record the GPU evicts counts as a use in the
  tier, if the tier holds it (a record that stays on the GPU for long is otherwise the tier's
  least recently used, and is dropped just before the GPU drops it too);
- `demote`: a record the GPU evicts is put into the tier (a device->host copy, counted) when the
  tier does not hold it.

`--uniform` replays seeded uniformly random routing instead (`--layers`, `--experts`, `--tokens`,
6 experts a token): the synthetic checkpoints' routing, as in the full-depth bench.

Sizes: `--device-slots` and `--tier-slots` (a number, or "rest": the records of the traced
layers the GPU cannot hold, as the memory plan sizes the tier). The trace is replayed
`--passes` times in a row (the full-depth bench cycles it too); each pass is reported, the last
being the steady state. Per token: disk reads (GB), RAM hits and demotions.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_replay import (EXPERT_RECORD_BYTES, Call, ReplayError, read_route_csv, route_calls,  # noqa: E402
                                serve_calls)
from engine.experts.cache import ExpertCache, ExpertKey  # noqa: E402
from engine.experts.policy import DEFAULT_POLICY, POLICIES  # noqa: E402

MODES = ("inclusive", "refresh", "demote")


@dataclass
class PassCounts:
    """What one pass over the trace did: GPU hits, RAM-tier hits, disk reads, demotions."""

    tokens: int
    uses: int = 0
    device_hits: int = 0
    ram_hits: int = 0
    disk_reads: int = 0
    demotions: int = 0

    @property
    def ram_share(self) -> float:
        """The share of the GPU's misses that the RAM tier served."""
        misses = self.ram_hits + self.disk_reads
        return self.ram_hits / misses if misses else 1.0


class TwoTiers:
    """A GPU cache of `device_slots` in front of a host tier of `tier_slots` (module docstring)."""

    def __init__(self, device_slots: int, tier_slots: int, mode: str, policy: str, num_layers: int,
                 num_experts: int):
        if mode not in MODES:
            raise ReplayError(f"unknown tier mode {mode!r}; choose one of {', '.join(MODES)}")
        if policy not in POLICIES:
            raise ReplayError(f"unknown policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if device_slots < 1 or tier_slots < 0:
            raise ReplayError("the GPU cache needs at least one slot and the tier none or more")
        self.mode = mode
        self.device = ExpertCache(device_slots, 1, num_layers=num_layers, num_experts=num_experts, policy=policy)
        self.tier = (ExpertCache(tier_slots, 1, num_layers=num_layers, num_experts=num_experts, policy=policy)
                     if tier_slots else None)

    def run(self, calls: Sequence[Call], counts: PassCounts) -> None:
        """Serve `calls` as the engine does (bench/cache_replay.py `serve_calls`), counting into `counts`."""

        def fetch(key: ExpertKey) -> None:  # a GPU miss: from the tier if it holds `key`, else the disk
            if self.tier is not None and self.tier.lookup(key) is not None:
                counts.ram_hits += 1
                return
            counts.disk_reads += 1
            if self.tier is not None:
                self.tier.admit(key)  # inclusive: every record read passes through the tier

        def evicted(key: ExpertKey) -> None:
            if self.tier is None or self.mode == "inclusive" or self.tier.touch(key):
                return  # refresh and demote alike: the eviction is a use in the tier
            if self.mode == "demote":
                self.tier.admit(key)
                counts.demotions += 1

        counts.uses += sum(len(call) for call in calls)
        counts.device_hits += serve_calls(self.device, calls, on_miss=fetch, on_evict=evicted)


def replay(calls: Sequence[Call], tokens: int, device_slots: int, tier_slots: int, mode: str,
           policy: str = DEFAULT_POLICY, passes: int = 2) -> list[PassCounts]:
    """The counts of each of `passes` consecutive passes over `calls` (`tokens` tokens a pass)."""
    layers = 1 + max(layer for call in calls for layer, _ in call)
    experts = 1 + max(e for call in calls for _, e in call)
    tiers = TwoTiers(device_slots, tier_slots, mode, policy, layers, experts)
    out = []
    for _ in range(passes):
        counts = PassCounts(tokens)
        tiers.run(calls, counts)
        out.append(counts)
    return out


def uniform_rows(layers: int, experts: int, tokens: int, top: int = 6, seed: int = 0) -> list[tuple]:
    """Route rows (pos, layer, expert ids) of uniformly random routing, seeded."""
    rng = random.Random(seed)
    return [(pos, layer, tuple(rng.sample(range(experts), top))) for pos in range(tokens) for layer in range(layers)]


def parse_slots(text: str, rest: int | None = None) -> list[int]:
    """Comma-separated slot counts; "rest" is `rest` (None: not allowed here)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "rest" and rest is not None:
            out.append(rest)
            continue
        try:
            value = int(part)
        except ValueError:
            raise ReplayError(f"slot count {part!r} is not a whole number"
                              + (' or "rest"' if rest is not None else "")) from None
        if value < 0:
            raise ReplayError(f"slot count {value} is negative")
        out.append(value)
    return out


def table(calls: Sequence[Call], tokens: int, pool: int, device_sizes: Sequence[int], tier_text: str,
          policy: str, passes: int, entry_bytes: int) -> str:
    lines = [f"{len(calls)} calls, {tokens} tokens a pass, {pool} expert records in the traced layers; "
             f"policy {policy}; {passes} passes (GB a token: {entry_bytes / 1e9:.4f} GB a record)", "",
             "| GPU slots | tier slots | mode | pass | GPU hit % | GPU misses from RAM % | disk GB / token "
             "| RAM GB / token | demotions / token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dev in device_sizes:
        for tier in parse_slots(tier_text, rest=max(0, pool - dev)):
            for mode in MODES:
                for i, c in enumerate(replay(calls, tokens, dev, tier, mode, policy, passes), 1):
                    lines.append(f"| {dev} | {tier} | {mode} | {i} | {100 * c.device_hits / c.uses:.1f} "
                                 f"| {100 * c.ram_share:.1f} | {c.disk_reads * entry_bytes / 1e9 / tokens:.3f} "
                                 f"| {c.ram_hits * entry_bytes / 1e9 / tokens:.3f} | {c.demotions / tokens:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", help="a route CSV (header pos,layer,n,e0..,w0..)")
    ap.add_argument("--uniform", action="store_true", help="seeded uniformly random routing instead of a trace")
    ap.add_argument("--layers", type=int, default=43, help="with --uniform: routed layers")
    ap.add_argument("--tokens", type=int, default=200, help="with --uniform: tokens a pass")
    ap.add_argument("--device-slots", default="1024,2560", help="GPU cache sizes (records)")
    ap.add_argument("--tier-slots", default="rest,1927",
                    help='host tier sizes (records; "rest": the traced pool beyond the GPU cache)')
    ap.add_argument("--experts", type=int, default=256, help="routed experts per layer of the model")
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--entry-bytes", type=int, default=EXPERT_RECORD_BYTES)
    a = ap.parse_args(argv)
    try:
        if a.uniform == bool(a.trace):
            raise ReplayError("give one route CSV, or --uniform")
        rows = uniform_rows(a.layers, a.experts, a.tokens) if a.uniform else read_route_csv(a.trace)
        calls = route_calls(rows)
        tokens = len({pos for pos, _, _ in rows})
        pool = len({layer for _, layer, _ in rows}) * a.experts
        if a.passes < 1:
            raise ReplayError("--passes must be at least 1")
        print(table(calls, tokens, pool, parse_slots(a.device_slots), a.tier_slots, a.policy, a.passes,
                    a.entry_bytes))
    except ReplayError as err:
        print(f"tier_replay: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

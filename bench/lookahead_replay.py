"""Replay a real routing trace through the engine's own StreamingExperts in the layered decode
step's order, with router lookahead hints of a chosen accuracy: what the hints cost in reads and
save in demand misses on real routing (issue 27 item 3).

    python -m bench.lookahead_replay ../shared/traces/route_W130.csv ../shared/traces/route_W50.csv
    python -m bench.lookahead_replay TRACE.csv --slots 1024,2048,8000 --accuracy off,0.5,0.87

Per token, per traced layer L, as `DecodeRunner._run` calls the provider in a layered step:
`acquire(L, route)` (hits held, misses read before it returns), then `prefetch_predicted(L+1,
predicted)` (the hint: predicted experts that are not resident are admitted and read), then
`release(L)`. The route CSVs hold routes, not the real model's lookahead predictions, so the
hint is a stand-in: each expert L+1 routes is named with probability `accuracy`, else one drawn
uniformly from the experts it does not route (seeded). The real model's lookahead accuracy is a
property of its trained weights, unknown here (the synthetic checkpoints' ~87 % says nothing
about it: their consecutive layers share no trained residual stream); and a real predictor's
wrong guesses are likely popular experts, more often resident than uniform draws.

Simplifications, said in the output: hash layers (not in the traces) take no slots; the first
traced layer of a token gets no hint; the pack is a tiny synthetic model with the trace's
layers and experts (built once into --workdir; records of a few KiB), so the replay counts
reads and does not time them; GB per token are at the real record size (12.75 MiB).

Figures per (cache slots, hint accuracy): the hit rate as the engine counts it (a prefetched
expert is a hit), demand misses per routed use (the route waited for a read), reads per routed
use (every admission: demand misses and hint reads), the hint reads used and unused, and the GB
read per token.
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

from bench.cache_replay import EXPERT_RECORD_BYTES, ReplayError, RouteRow, read_route_csv  # noqa: E402
from bench.full_depth import build_pack  # noqa: E402
from engine.experts.hint_gate import HintGate  # noqa: E402
from engine.experts.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from engine.experts.provider import ExpertProvider  # noqa: E402

DEFAULT_SLOTS = "1024,2048,8000"  # 8,000 of the real pool's 11,008: a DGX Spark's 100 GB arena
DEFAULT_ACCURACY = "off,0.5,0.87"


@dataclass(frozen=True)
class ReplayCounts:
    """What one replay did (engine counters, differences over the replay)."""

    tokens: int
    uses: int  # routed (layer, expert) uses
    hits: int  # lookups that found the expert resident (prefetched ones included)
    misses: int  # demand misses: the route waited for the read
    reads: int  # admissions: demand misses and hint reads
    hint_reads: int  # reads a hint started
    hint_used: int  # of them, asked for by the route
    hint_unused: int
    hint_skipped: int  # reads the hint gate (engine/experts/hint_gate.py) did not start
    hint_skipped_used: int  # of them, asked for by the route

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    def gb_per_token(self, record_bytes: int = EXPERT_RECORD_BYTES) -> float:
        return self.reads * record_bytes / 1e9 / self.tokens if self.tokens else 0.0


def route_steps(rows: Sequence[RouteRow]) -> tuple[list[int], list[dict[int, list[int]]]]:
    """(the traced layers in order, one {layer: distinct expert ids} per token position)."""
    steps: dict[int, dict[int, list[int]]] = {}
    for pos, layer, experts in rows:
        steps.setdefault(pos, {})[layer] = list(dict.fromkeys(experts))
    layers = sorted({layer for _, layer, _ in rows})
    for pos, route in steps.items():
        if sorted(route) != layers:
            raise ReplayError(f"token position {pos} routes layers {sorted(route)}, not every traced layer {layers}")
    return layers, [steps[pos] for pos in sorted(steps)]


def traced_pack(rows: Sequence[RouteRow], workdir: Path) -> tuple[list[int], list[dict[int, list[int]]], Path]:
    """`route_steps(rows)` and the tiny pack with the trace's layers and experts (built once into
    `workdir`: records of a few KiB, for counting reads, not timing them)."""
    layers, steps = route_steps(rows)
    n_experts = 1 + max(max(route[layer]) for route in steps for layer in layers)
    return layers, steps, build_pack(workdir, layers[-1] + 1, n_experts, tiny=True)


def predict(route: list[int], accuracy: float, n_experts: int, rng: random.Random) -> list[int]:
    """The stand-in lookahead: each routed id kept with probability `accuracy`, else replaced by
    one the route does not hold, drawn uniformly."""
    routed = set(route)
    others = [e for e in range(n_experts) if e not in routed]
    return [e if rng.random() < accuracy or not others else rng.choice(others) for e in route]


def replay(provider: ExpertProvider, layers: Sequence[int], steps: Sequence[dict[int, list[int]]],
           accuracy: float | None, seed: int = 0) -> ReplayCounts:
    """Serve `steps` through `provider` in the layered decode step's order (module docstring);
    `accuracy` None: no hints."""
    rng = random.Random(seed)
    before, ledger0 = provider.stats(), provider.prefetch_stats()["lookahead"]
    uses = 0
    for route in steps:
        for i, layer in enumerate(layers):
            provider.acquire(layer, route[layer])
            uses += len(route[layer])
            if accuracy is not None and i + 1 < len(layers):
                nxt = layers[i + 1]
                provider.prefetch_predicted(nxt, predict(route[nxt], accuracy, provider.n_experts, rng))
            provider.release(layer)
    after, ledger = provider.stats(), provider.prefetch_stats()["lookahead"]
    return ReplayCounts(tokens=len(steps), uses=uses, hits=after.hits - before.hits,
                        misses=after.misses - before.misses, reads=after.admissions - before.admissions,
                        hint_reads=ledger.issued - ledger0.issued, hint_used=ledger.used - ledger0.used,
                        hint_unused=ledger.unused - ledger0.unused, hint_skipped=ledger.skipped - ledger0.skipped,
                        hint_skipped_used=ledger.skipped_used - ledger0.skipped_used)


def run(pack: Path, layers: Sequence[int], steps: Sequence[dict[int, list[int]]], slots: int,
        accuracy: float | None, policy: str = DEFAULT_POLICY, seed: int = 0, warm: int = 0,
        gate: bool = True) -> ReplayCounts:
    """One replay on a fresh StreamingExperts over `pack` with a cache of `slots` records, after
    `warm` uncounted passes over `steps` (with the same hints: a conversation's earlier turns);
    `gate` False: the hints read whatever the outcome of earlier reads (engine/experts/hint_gate.py)."""
    from engine.pack import read_manifest
    from engine.weights import open_model

    record = read_manifest(pack).record.record_bytes
    files = open_model(pack, cache_bytes=slots * record, policy=policy,
                       hint_gate=None if gate else HintGate.never_closing())
    try:
        for i in range(warm):
            replay(files.experts, layers, steps, accuracy, seed + 1 + i)
        return replay(files.experts, layers, steps, accuracy, seed)
    finally:
        files.close()


def _accuracies(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "off":
            out.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise ReplayError(f"--accuracy takes 'off' or numbers in [0, 1], got {part!r}") from None
        if not 0.0 <= value <= 1.0:
            raise ReplayError(f"--accuracy takes 'off' or numbers in [0, 1], got {part!r}")
        out.append(value)
    return out


def _slots(text: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",")]
    except ValueError:
        raise ReplayError(f"--slots takes positive integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ReplayError(f"--slots takes positive integers, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.lookahead_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="route CSVs (header pos,layer,n,e0..)")
    p.add_argument("--slots", default=DEFAULT_SLOTS, help=f"cache sizes in records (default {DEFAULT_SLOTS})")
    p.add_argument("--accuracy", default=DEFAULT_ACCURACY,
                   help=f"stand-in lookahead accuracies, 'off' for no hints (default {DEFAULT_ACCURACY})")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate", choices=("on", "off", "both"), default="on",
                   help="the lookahead hints' gate (engine/experts/hint_gate.py); both: one row each")
    p.add_argument("--warm", type=int, default=0, help="uncounted passes over the trace first (a warm cache)")
    p.add_argument("--workdir", default="/tmp/dsv4-lookahead-replay", help="where the tiny pack is built once")
    a = p.parse_args(argv)
    try:
        slots, accuracies = _slots(a.slots), _accuracies(a.accuracy)
        traces = [(Path(t).stem, read_route_csv(t)) for t in a.traces]
    except ReplayError as e:
        print(f"bench.lookahead_replay: {e}", file=sys.stderr)
        return 2
    print("StreamingExperts in the layered decode step's order; stand-in lookahead (module docstring); hash "
          "layers take no slots; reads counted, not timed; GB at 12.75 MiB a record", flush=True)
    for name, rows in traces:
        try:
            layers, steps, pack = traced_pack(rows, Path(a.workdir))
        except ReplayError as e:
            print(f"bench.lookahead_replay: {name}: {e}", file=sys.stderr)
            return 2
        print(f"\n{name}: {len(steps)} tokens, layers {layers[0]}..{layers[-1]}, policy {a.policy}"
              + (f", after {a.warm} uncounted passes" if a.warm else ""))
        print(f"  {'slots':>6} {'hints':>12} | {'hit rate':>8} {'misses/use':>10} {'reads/use':>9} "
              f"{'hint reads used / unused':>24} {'skipped (would be used)':>23} {'GB/token':>8}")
        gates = {"on": (True,), "off": (False,), "both": (False, True)}[a.gate]
        runs = [(acc, gate) for acc in accuracies for gate in ((True,) if acc is None else gates)]
        for n in slots:
            for acc, gate in runs:
                c = run(pack, layers, steps, n, acc, a.policy, a.seed, a.warm, gate)
                hints = "off" if acc is None else f"{acc:.0%}" + ("" if gate else " ungated")
                print(f"  {n:>6} {hints:>12} | {c.hit_rate:>8.1%} {c.misses / c.uses:>10.3f} {c.reads / c.uses:>9.3f} "
                      f"{f'{c.hint_used} / {c.hint_unused}':>24} {f'{c.hint_skipped} ({c.hint_skipped_used})':>23} "
                      f"{c.gb_per_token():>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

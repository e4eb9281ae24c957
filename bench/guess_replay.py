"""Replay a real routing trace through the engine's own StreamingExperts and StepGuess: how often a
streamed decode step guessed whole (engine/step_guess.py) would be right, wrong (redone layer by
layer) or not guessed, per cache size and guess policy.

    python -m bench.guess_replay ../shared/traces/route_W130.csv --slots 1024,3700,8000 --warm 1

Per token, as `DecodeRunner.step` does: when the policy is ready, the step is guessed and the
provider checks the token's routes (`first_missing`): all resident, the routes are counted as a
whole step's (`record_routes`); else the step is redone layer by layer (`acquire`, `release`
per traced layer, no hints). When it is not ready the step goes layer by layer, and the policy
sees whether every layer's experts were `resident` at its turn. Hash layers (not in the
traces) take no slots; the pack is a tiny synthetic model with the trace's layers and experts
(bench/lookahead_replay.py), so steps are counted, not timed.

With `--chunk N` the trace's tokens come as prefill chunks of N (a follow-up turn's new tokens,
`DecodeRunner.chunk`): when the policy is ready a chunk is guessed whole and checked on the union
of its tokens' routes: all resident, counted as one chunk step (`record_routes` of each layer's
distinct experts); else its tokens run as decode steps (guessed or layered as above). Its counts
are `chunks` and `chunks_wrong`; `right`, `wrong` and `layered` stay the decode steps'.

A guess pays when the share of guesses that are right exceeds W / L (a whole step's device time
over a layered one's: a wrong guess costs W on top of the layered redo). With `--whole-ms W
--layered-ms L` (figures measured elsewhere, given by the caller) each row also models ms per
token: right·W + wrong·(W + L) + layered·L over the tokens.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_replay import ReplayError, read_route_csv  # noqa: E402
from bench.lookahead_replay import traced_pack  # noqa: E402
from engine.chunk_position import CHUNK_SLOTS  # noqa: E402
from engine.experts.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from engine.experts.provider import ExpertProvider  # noqa: E402
from engine.step_guess import StepGuess  # noqa: E402

# name -> a fresh policy, or None: never guess (every step layered)
GUESSES: dict[str, Callable[[], StepGuess] | None] = {"never": None, "default": StepGuess,
                                                      "every": lambda: StepGuess(least=0, most=0)}


@dataclass(frozen=True)
class GuessCounts:
    """What one replay's steps did."""

    tokens: int
    resident: int  # steps whose every routed expert was resident at the step's start
    right: int  # guessed whole, all resident: one whole step
    wrong: int  # guessed whole, redone layer by layer
    layered: int  # not guessed
    misses: int  # demand misses over the replay
    chunks: int = 0  # prefill chunks guessed whole (`--chunk`)
    chunks_wrong: int = 0  # of those, their tokens redone as decode steps

    def model_ms(self, whole_ms: float, layered_ms: float) -> float:
        """Modelled device time per token (module docstring)."""
        return (self.right * whole_ms + self.wrong * (whole_ms + layered_ms)
                + self.layered * layered_ms) / self.tokens


def _layered(provider: ExpertProvider, layers: Sequence[int], route: dict[int, list[int]]) -> bool:
    """One layered step (acquire, release per layer) -> whether every layer was resident at its turn."""
    every = True
    for layer in layers:
        every = provider.resident(layer, route[layer]) and every
        provider.acquire(layer, route[layer])
        provider.release(layer)
    return every


def _full(layers: Sequence[int], route: dict[int, list[int]]) -> list[list[int]]:
    """A route's experts from layer 0 (the hash layers', not traced, empty)."""
    return [route.get(layer, []) for layer in range(layers[-1] + 1)]


def _decode(provider: ExpertProvider, layers: Sequence[int], route: dict[int, list[int]],
            guess: StepGuess | None, c: dict[str, int]) -> None:
    """One decode step as `DecodeRunner.step` serves it, counted into `c`."""
    full = _full(layers, route)
    all_in = provider.first_missing(full) is None
    c["resident"] += all_in
    if guess is not None and guess.ready():
        if all_in:
            guess.right()
            provider.record_routes(full)
            c["right"] += 1
            return
        guess.missed()
        c["wrong"] += 1
        _layered(provider, layers, route)
        return
    c["layered"] += 1
    every = _layered(provider, layers, route)
    if guess is not None:
        guess.observed(every)


def replay(provider: ExpertProvider, layers: Sequence[int], steps: Sequence[dict[int, list[int]]],
           guess: StepGuess | None, chunk: int = 1) -> GuessCounts:
    """Serve `steps` through `provider` as the decode runner would with `guess` (None: never):
    one decode step a token, or (`chunk` > 1) prefill chunks of `chunk` tokens (module docstring)."""
    before = provider.stats()
    c = dict.fromkeys(("resident", "right", "wrong", "layered", "chunks", "chunks_wrong"), 0)
    for i in range(0, len(steps), chunk):
        part = steps[i:i + chunk]
        if len(part) > 1 and guess is not None and guess.ready():
            union = [sorted({e for ids in rows for e in ids}) for rows in zip(*(_full(layers, r) for r in part))]
            c["chunks"] += 1
            if provider.first_missing(union) is None:
                guess.right(chunk=True)
                provider.record_routes(union)
                c["resident"] += len(part)
                continue
            guess.missed(chunk=True)
            c["chunks_wrong"] += 1
        for route in part:
            _decode(provider, layers, route, guess, c)
    after = provider.stats()
    return GuessCounts(tokens=len(steps), misses=after.misses - before.misses, **c)


def run(pack: Path, layers: Sequence[int], steps: Sequence[dict[int, list[int]]], slots: int,
        guess: Callable[[], StepGuess] | None, policy: str = DEFAULT_POLICY, warm: int = 0,
        chunk: int = 1) -> GuessCounts:
    """One replay on a fresh StreamingExperts over `pack` with a cache of `slots` records, after
    `warm` uncounted layered passes over `steps` (a conversation's earlier turns); `guess`
    makes the policy (None: never guess); `chunk`: tokens as prefill chunks of that many."""
    from engine.pack import read_manifest
    from engine.weights import open_model

    record = read_manifest(pack).record.record_bytes
    files = open_model(pack, cache_bytes=slots * record, policy=policy)
    try:
        for _ in range(warm):
            replay(files.experts, layers, steps, None)
        return replay(files.experts, layers, steps, None if guess is None else guess(), chunk)
    finally:
        files.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.guess_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="route CSVs (header pos,layer,n,e0..)")
    p.add_argument("--slots", default="1024,3700,8000", help="cache sizes in records")
    p.add_argument("--guesses", default="never,default,every",
                   help=f"guess policies, of {', '.join(GUESSES)} (default: all)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    p.add_argument("--warm", type=int, default=0, help="uncounted layered passes over the trace first")
    p.add_argument("--chunk", type=int, default=1,
                   help="the tokens as prefill chunks of this many (guessed whole as chunk steps), not decode steps")
    p.add_argument("--whole-ms", type=float, help="a whole step's device time, to model ms per token")
    p.add_argument("--layered-ms", type=float, help="a layered step's device time, to model ms per token")
    p.add_argument("--workdir", default="/tmp/dsv4-lookahead-replay", help="where the tiny pack is built once")
    a = p.parse_args(argv)
    try:
        slots = [int(x) for x in a.slots.split(",")]
    except ValueError:
        slots = []
    if not slots or min(slots) < 1:
        print(f"bench.guess_replay: --slots takes positive integers, got {a.slots!r}", file=sys.stderr)
        return 2
    names = [n.strip() for n in a.guesses.split(",")]
    unknown = [n for n in names if n not in GUESSES]
    if unknown:
        print(f"bench.guess_replay: --guesses takes names of {', '.join(GUESSES)}, got {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    if not 1 <= a.chunk <= CHUNK_SLOTS:
        print(f"bench.guess_replay: --chunk takes 1..{CHUNK_SLOTS} tokens (a chunk step's slots), got {a.chunk}",
              file=sys.stderr)
        return 2
    if a.chunk > 1 and a.whole_ms is not None:
        print("bench.guess_replay: --whole-ms and --layered-ms model decode steps; leave them out with --chunk",
              file=sys.stderr)
        return 2
    if (a.whole_ms is None) != (a.layered_ms is None):
        print("bench.guess_replay: --whole-ms and --layered-ms model ms per token together: give both or neither",
              file=sys.stderr)
        return 2
    try:
        traces = [(Path(t).stem, read_route_csv(t)) for t in a.traces]
    except ReplayError as e:
        print(f"bench.guess_replay: {e}", file=sys.stderr)
        return 2
    model = a.whole_ms is not None
    print("StreamingExperts and StepGuess in the decode runner's order (module docstring); hash layers take "
          "no slots; steps counted, not timed" + (f"; modelled with a whole step of {a.whole_ms} ms and a "
                                                   f"layered one of {a.layered_ms} ms (given)" if model else ""),
          flush=True)
    for name, rows in traces:
        try:
            layers, steps, pack = traced_pack(rows, Path(a.workdir))
        except ReplayError as e:
            print(f"bench.guess_replay: {name}: {e}", file=sys.stderr)
            return 2
        print(f"\n{name}: {len(steps)} tokens, layers {layers[0]}..{layers[-1]}, policy {a.policy}"
              + (f", after {a.warm} uncounted passes" if a.warm else "")
              + (f", in prefill chunks of {a.chunk}" if a.chunk > 1 else ""))
        print(f"  {'slots':>6} {'guesses':>8} | {'all resident':>12} {'right':>6} {'wrong':>6} {'layered':>8} "
              f"{'right share':>11} {'misses/token':>12}" + (f" {'model ms/token':>14}" if model else "")
              + (f" {'chunks right':>12} {'wrong':>6}" if a.chunk > 1 else ""))
        for n in slots:
            for g in names:
                c = run(pack, layers, steps, n, GUESSES[g], a.policy, a.warm, a.chunk)
                share = f"{c.right / (c.right + c.wrong):.1%}" if c.right + c.wrong else "-"
                print(f"  {n:>6} {g:>8} | {c.resident:>12} {c.right:>6} {c.wrong:>6} {c.layered:>8} {share:>11} "
                      f"{c.misses / c.tokens:>12.2f}"
                      + (f" {c.model_ms(a.whole_ms, a.layered_ms):>14.2f}" if model else "")
                      + (f" {c.chunks - c.chunks_wrong:>12} {c.chunks_wrong:>6}" if a.chunk > 1 else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

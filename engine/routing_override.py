"""Forced routing for benchmarks (issue 27 item 4): the routed experts of the layers at and
after `n_hash_layers` taken from a recorded routing trace instead of the router. TIMING ONLY:
the tokens then see experts their router did not choose, so the model's output is meaningless.

Trace format: CSV with header `pos,layer,n,e0..e{m-1},w0..w{m-1}`, one row per (token, layer),
the hash layers absent (../shared/traces/README.md). Every token must carry the same layers.
Mapping onto a model (`ForcedRouting.from_csv`):

* tokens: the trace's positions in increasing order are tokens 0..T-1; the run's position p
  takes token p mod T, so a run longer than the trace cycles it;
* layers: the model's j-th router-routed layer (layer n_hash_layers + j) takes the trace's j-th
  recorded layer, cycling when the model has more; the real model's layers 3..42 map to
  themselves. The MTP block is not forced;
* experts: a model routing k < n experts a token takes the k with the largest trace weights
  (in the trace's column order); k > n is refused. When the model has fewer routed experts E
  than the trace addresses, ids are taken modulo E, and an id that then repeats within one
  token's choices moves to the next id (mod E) not yet chosen, so every token still reads k
  distinct experts (the bytes real routing reads);
* routing weights: the model's own router scores at the forced ids, normalised and scaled as on a
  hash layer (`reference.moe_gate` with hash_ids); the router's matmul so stays in the timed
  step, and no kernel variant beyond the hash layers' is needed.

On the device: `table` [n_layers, T, k] int64 (rows of layers not forced are unused). A prefill
chunk's ids are `index_select`ed from it on the device (`prefill_ids`, no host sync). A decode
step's are a view of the static buffer `step` [n_layers, k], which `set_position(p)` fills with
token p mod T (one device copy queued before the step), so a captured CUDA graph reads each
step's forced ids (engine/decode_graph.py calls it before every step). A graphed chunk step's
CHUNK_SLOTS token slots read theirs likewise from `chunk` [n_layers, CHUNK_SLOTS, k]
(`set_chunk(p0)`: slot t takes position p0 + t; the slots past the chunk's tokens are never
committed).

Router lookahead (`Transformer.predict_next`: layer L+1's gate on layer L's state) means nothing
on a forced layer, whose experts are not its router's. With `lookahead_accuracy` a, a stand-in
takes its place: `guess` [n_layers, T, k] names each forced id with probability a, else an id
the token does not route there (drawn uniformly, no repeats; seeded, so every run guesses the
same), read like the forced ids (`lookahead_ids`), so that a streamed run at full depth can
weigh the hints' reads against the misses they save on real routing. Without it a forced layer
gets no hints.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.chunk_position import CHUNK_SLOTS
from engine.config import ModelArgs


class RoutingTraceError(ValueError):
    """A routing trace that cannot drive the model (the message names the problem and the fix)."""


@dataclass(frozen=True)
class TraceRoutes:
    """A route CSV as read: `experts[t][j]` and `weights[t][j]` are token t's choices on the trace's
    j-th recorded layer `layers[j]`; tokens ordered by position."""

    path: str
    positions: tuple[int, ...]
    layers: tuple[int, ...]
    experts: tuple[tuple[tuple[int, ...], ...], ...]  # [T][L][n]
    weights: tuple[tuple[tuple[float, ...], ...], ...]  # [T][L][n]

    @property
    def max_expert(self) -> int:
        """The largest expert id in the trace."""
        return max(e for token in self.experts for row in token for e in row)


def read_route_csv(path: str | Path) -> TraceRoutes:
    """Parse a route CSV (module docstring); RoutingTraceError on anything malformed."""
    p = Path(path)
    if not p.is_file():
        raise RoutingTraceError(f"routing trace {p} does not exist: pass a route CSV such as "
                                "shared/traces/route_W130.csv")
    by_token: dict[int, dict[int, tuple[tuple[int, ...], tuple[float, ...]]]] = {}
    try:
        with open(p, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header or header[:3] != ["pos", "layer", "n"] or "e0" not in header or "w0" not in header:
                raise RoutingTraceError(f"{p}: expected a header pos,layer,n,e0..,w0..; got {header}")
            e0, w0 = header.index("e0"), header.index("w0")
            for lineno, fields in enumerate(reader, 2):
                try:
                    pos, layer, n = int(fields[0]), int(fields[1]), int(fields[2])
                    experts = tuple(int(x) for x in fields[e0:e0 + n])
                    weights = tuple(float(x) for x in fields[w0:w0 + n])
                except (ValueError, IndexError):
                    raise RoutingTraceError(f"{p}:{lineno}: pos, layer, n, then n expert ids and n weights "
                                            "are expected; fix or re-export the trace") from None
                if n < 1 or len(experts) != n or len(weights) != n or min(experts) < 0 or pos < 0 or layer < 0:
                    raise RoutingTraceError(f"{p}:{lineno}: needs n >= 1 non-negative expert ids and n weights")
                if layer in by_token.setdefault(pos, {}):
                    raise RoutingTraceError(f"{p}:{lineno}: position {pos} layer {layer} appears twice")
                by_token[pos][layer] = (experts, weights)
    except (OSError, UnicodeDecodeError) as exc:
        raise RoutingTraceError(f"routing trace {p} is not a readable UTF-8 CSV ({exc})") from None
    if not by_token:
        raise RoutingTraceError(f"routing trace {p} holds no routing rows")
    positions = tuple(sorted(by_token))
    layers = tuple(sorted(by_token[positions[0]]))
    for pos in positions:
        if tuple(sorted(by_token[pos])) != layers:
            raise RoutingTraceError(f"{p}: position {pos} records layers {sorted(by_token[pos])}, position "
                                    f"{positions[0]} records {list(layers)}: every token needs the same layers")
    return TraceRoutes(str(p), positions, layers,
                       tuple(tuple(by_token[pos][layer][0] for layer in layers) for pos in positions),
                       tuple(tuple(by_token[pos][layer][1] for layer in layers) for pos in positions))


def map_choice(experts: tuple[int, ...], weights: tuple[float, ...], k: int, n_experts: int) -> list[int]:
    """One token's forced ids on a model with `n_experts` routed experts routing `k` a token: the k
    largest weights (ties: earlier column), in column order, modulo n_experts, a repeated id moved
    to the next free one (module docstring)."""
    keep = sorted(sorted(range(len(experts)), key=lambda j: (-weights[j], j))[:k])
    out: list[int] = []
    for j in keep:
        e = experts[j] % n_experts
        while e in out:
            e = (e + 1) % n_experts
        out.append(e)
    return out


class ForcedRouting:
    """Expert ids forced from a trace for the router-routed layers of one model (module docstring)."""

    def __init__(self, routes: TraceRoutes, args: ModelArgs, device: torch.device | str,
                 lookahead_accuracy: float | None = None, seed: int = 0):
        """`lookahead_accuracy`: the stand-in lookahead's share of right guesses (module docstring),
        or None for no hints on forced layers."""
        k, n_experts = args.n_activated_experts, args.n_routed_experts
        if lookahead_accuracy is not None and not 0.0 <= lookahead_accuracy <= 1.0:
            raise RoutingTraceError(f"the stand-in lookahead's accuracy must be in [0, 1], got {lookahead_accuracy}")
        n_trace = len(routes.experts[0][0])
        if k > n_trace:
            raise RoutingTraceError(f"{routes.path}: the trace routes {n_trace} experts a token but the model routes "
                                    f"{k}: use a trace recorded with at least {k}")
        self.path, self.tokens, self.args = routes.path, len(routes.positions), args
        self.first = args.n_hash_layers  # layers first..n_layers-1 are forced
        self.max_expert = routes.max_expert
        table = torch.zeros(args.n_layers, self.tokens, k, dtype=torch.long)
        for layer in range(self.first, args.n_layers):
            j = (layer - self.first) % len(routes.layers)
            for t in range(self.tokens):
                table[layer, t] = torch.tensor(map_choice(routes.experts[t][j], routes.weights[t][j], k, n_experts))
        self.trace_layers = {layer: routes.layers[(layer - self.first) % len(routes.layers)]
                             for layer in range(self.first, args.n_layers)}
        self.table = table.to(device)  # [n_layers, T, k]
        self.step = torch.zeros(args.n_layers, k, dtype=torch.long, device=device)  # a decode step's ids
        self.chunk = torch.zeros(args.n_layers, CHUNK_SLOTS, k, dtype=torch.long, device=device)  # a chunk step's ids
        self.lookahead_accuracy = lookahead_accuracy
        self.guess = self.guess_step = None
        if lookahead_accuracy is not None:
            self.guess = stand_in_guesses(table, self.first, n_experts, lookahead_accuracy, seed).to(device)
            self.guess_step = torch.zeros_like(self.step)  # a decode step's guesses

    @classmethod
    def from_csv(cls, path: str | Path, args: ModelArgs, device: torch.device | str,
                 lookahead_accuracy: float | None = None) -> "ForcedRouting":
        return cls(read_route_csv(path), args, device, lookahead_accuracy)

    def forces(self, layer: int) -> bool:
        """Whether `layer`'s experts come from the trace (router-routed main layers only)."""
        return self.first <= layer < self.args.n_layers

    def host_ids(self, layer: int, pos: int) -> list[int]:
        """The forced ids of `layer` at sequence position `pos` (host copy; for tests and reports)."""
        return self.table[layer, pos % self.tokens].tolist()

    def prefill_ids(self, layer: int, start: int, n: int) -> torch.Tensor:
        """Forced ids [n, k] of positions start..start+n-1, gathered on the device."""
        rows = torch.arange(start, start + n, device=self.table.device).remainder_(self.tokens)
        return self.table[layer].index_select(0, rows)

    def set_position(self, pos: int) -> None:
        """Fill `step` (and `guess_step`) with position pos's ids (device copies on the current
        stream, no host sync)."""
        self.step.copy_(self.table[:, pos % self.tokens])
        if self.guess is not None:
            self.guess_step.copy_(self.guess[:, pos % self.tokens])

    def decode_ids(self, layer: int) -> torch.Tensor:
        """The current decode step's forced ids of `layer` [1, k]: a view of `step`."""
        return self.step[layer:layer + 1]

    def set_chunk(self, start: int) -> None:
        """Fill `chunk` with the ids of positions start..start+CHUNK_SLOTS-1 (device ops on the
        current stream, no host sync)."""
        rows = torch.arange(start, start + CHUNK_SLOTS, device=self.table.device).remainder_(self.tokens)
        torch.index_select(self.table, 1, rows, out=self.chunk)

    def chunk_ids(self, layer: int) -> torch.Tensor:
        """The current chunk step's forced ids of `layer` [CHUNK_SLOTS, k]: a view of `chunk`."""
        return self.chunk[layer]

    def lookahead_ids(self, layer: int, start: int | None = None, n: int = 1) -> torch.Tensor | None:
        """The stand-in lookahead's guesses of forced `layer`'s ids: [n, k] of positions
        start..start+n-1, or (start None) the current decode step's [1, k], a view of `guess_step`;
        None without a stand-in."""
        if self.guess is None:
            return None
        if start is None:
            return self.guess_step[layer:layer + 1]
        rows = torch.arange(start, start + n, device=self.guess.device).remainder_(self.tokens)
        return self.guess[layer].index_select(0, rows)

    @property
    def note(self) -> str:
        """What a benchmark prints: the source, that it is timing only, and the mapping used."""
        a = self.args
        layers = f"layers {self.first}..{a.n_layers - 1}" if self.first < a.n_layers else "no layer"
        parts = [f"routing forced from {self.path}: timing only (the generated text is meaningless)",
                 f"{layers} forced, {self.tokens} trace tokens cycled, {a.n_activated_experts} experts a token"]
        if self.guess is not None:
            parts.append(f"router lookahead on forced layers: a stand-in right {self.lookahead_accuracy:.0%} of the "
                         "time (its wrong guesses drawn uniformly from the experts not routed)")
        else:
            parts.append("no router lookahead on forced layers")
        if self.max_expert >= a.n_routed_experts:
            parts.append(f"expert ids taken mod {a.n_routed_experts}, the model's experts a layer (the trace's "
                         f"reach {self.max_expert}; a repeat within a token moves to the next free id)")
        return "; ".join(parts)


def stand_in_guesses(table: torch.Tensor, first: int, n_experts: int, accuracy: float, seed: int) -> torch.Tensor:
    """[n_layers, T, k] guesses of `table`'s forced ids (layers >= first): each id kept with
    probability `accuracy`, else an id not in that token's route nor already guessed, uniformly."""
    rng = random.Random(seed)
    guess = table.clone()
    for layer in range(first, table.shape[0]):
        for t in range(table.shape[1]):
            route = table[layer, t].tolist()
            keep = [rng.random() < accuracy for _ in route]
            taken = set(route)
            out = []
            for e, kept in zip(route, keep):
                if not kept and len(taken) < n_experts:
                    e = rng.randrange(n_experts)
                    while e in taken:  # uniform over the ids not taken
                        e = rng.randrange(n_experts)
                    taken.add(e)
                out.append(e)
            guess[layer, t] = torch.tensor(out)
    return guess


def forced_routing(trace: str | None, args: ModelArgs, device: torch.device | str,
                   lookahead_accuracy: float | None = None) -> ForcedRouting | None:
    """The ForcedRouting of `EngineConfig.routing_trace` (None: the router decides), with the
    stand-in lookahead of `EngineConfig.routing_lookahead`."""
    return None if trace is None else ForcedRouting.from_csv(trace, args, device, lookahead_accuracy)

"""Mixture of experts of one layer (spec §C.7): routing, routed experts, shared expert.

Routed-expert weights are not held here: the MoE asks an `ExpertProvider`
(engine/experts/provider.py) for the experts a call needs, and the provider may hand them over in
any order (resident hits first, then misses as they arrive). Each expert's output is written to
its (token, slot) cell and the slots are summed in routing order at the end, so the result does
not depend on that order. In native numerics, when the provider's arena holds every expert of a
call (all resident, or held for the call by `acquire`), all its cells go through one `fp4_moe`
call instead (`MoE._arena_cells`), on any device, grouped by expert: the host learns how many
cells each expert has in one synchronisation per layer (which experts to hold, and the grouped
GEMMs' spans), or in none when every expert is resident and the layer's experts make one group of
the tensor cores' path (`Cells.one_group`; its uses are then counted after the call,
`ExpertProvider.record_later`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelArgs
from engine.experts.provider import ExpertProvider, used_experts
from engine.experts.weights import ExpertWeights
from engine.lanes import Lanes
from engine.numerics import Numerics, Quantized
from kernels.fp4_moe import EXPERTS_PER_DEQUANT, dense, expert_groups


class Gate:
    """Router: sqrt-softplus scores; top-k on score + bias (bias selects only), or tid2eid.
    The math is `reference.moe_gate`; the numerics run it (native: the backend's, two launches on CUDA)."""

    def __init__(self, get, prefix: str, args: ModelArgs, layer: int, numerics: Numerics):
        self.weight = get(f"{prefix}.weight").float()
        self.hash = args.is_hash_layer(layer) and layer < args.n_layers
        self.tid2eid = get(f"{prefix}.tid2eid").long() if self.hash else None
        self.tid2eid_host = self.tid2eid.cpu() if self.hash else None  # for prefetch hints
        self.bias = None if self.hash else get(f"{prefix}.bias").float()
        self.k, self.route_scale = args.n_activated_experts, args.route_scale
        self.numerics = numerics

    def __call__(self, x: torch.Tensor, ids: torch.Tensor,
                 forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], token ids [N] -> (expert indices [N, k] int64, routing weights [N, k] fp32).
        `forced` [N, k] (engine/routing_override.py, timing only) replaces the choice; the weights
        are then the router's scores at those ids, normalised as on a hash layer."""
        if forced is not None:
            return self.numerics.moe_gate(x, self.weight, None, self.k, self.route_scale, forced)
        hash_ids = self.tid2eid[ids] if self.hash else None
        return self.numerics.moe_gate(x, self.weight, self.bias, self.k, self.route_scale, hash_ids)


class MoE:
    """Routed experts (through the provider) + the shared expert, summed in fp32."""

    def __init__(self, get, prefix: str, args: ModelArgs, layer: int, numerics: Numerics):
        self.layer, self.numerics, self.limit = layer, numerics, args.swiglu_limit
        self.gate = Gate(get, f"{prefix}.gate", args, layer, numerics)
        w = {n: (get(f"{prefix}.shared_experts.{n}.weight"), get(f"{prefix}.shared_experts.{n}.scale"))
             for n in ("w1", "w3", "w2")}
        self.shared = numerics.shared_expert_weights(w["w1"], w["w3"], w["w2"])  # prepared for the mode

    def route(self, x: torch.Tensor, ids: torch.Tensor,
              forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's (ids, weights) of x [N, D]; `forced` [N, k] ids override the choice (`Gate`)."""
        return self.gate(x, ids, forced)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, provider: ExpertProvider,
                 routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [N, D] (ffn-normed), token ids [N] -> [N, D]. `routed` reuses a precomputed route."""
        idx, w = routed if routed is not None else self.route(x, ids)
        if not self._batched(provider):
            return self._expert_loop(x, idx, w, provider)
        cells = Cells(idx, provider.n_experts)
        arena = provider.arena
        if provider.all_resident() and cells.one_group:  # no host sync: counted once the device has run it
            provider.record_later(self.layer, cells.counts)
            return self._arena_cells(x, w, cells, arena, cells.all_groups(arena.table[self.layer]))
        counts = cells.counts.tolist()  # the layer's one host sync
        wanted = used_experts(counts)
        if provider.all_resident():
            provider.record(self.layer, wanted)  # usage and cache statistics
            return self._arena_cells(x, w, cells, arena, cells.groups(counts, arena.slots_of(self.layer, wanted)))
        if not provider.can_acquire(len(wanted)):
            return self._expert_loop(x, idx, w, provider)
        provider.acquire(self.layer, wanted)  # every expert of the call read once, then held
        try:
            return self._arena_cells(x, w, cells, arena, cells.groups(counts, arena.slots_of(self.layer, wanted)))
        finally:
            provider.release(self.layer)  # the kernels are enqueued: a reassigned slot waits for them

    def _expert_loop(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                     provider: ExpertProvider) -> torch.Tensor:
        """The experts one at a time, each on the tokens routed to it, in the provider's order."""
        n, k = idx.shape
        slots = torch.zeros(n, k, x.shape[1], device=x.device)  # [N, k, D] fp32: one cell per (token, choice)
        # The one host round trip of the layer: the residency check needs the expert ids anyway.
        cells: dict[int, list[tuple[int, int]]] = {}
        for r, row in enumerate(idx.tolist()):
            for c, e in enumerate(row):
                cells.setdefault(e, []).append((r, c))
        wanted = sorted(cells)
        spans, start = {}, 0
        for e in wanted:
            spans[e] = (start, start + len(cells[e]))
            start += len(cells[e])
        # (token, choice) cells grouped by expert, copied to the device once, right after the sync.
        where = torch.tensor([rc for e in wanted for rc in cells[e]], device=x.device).T  # [2, N·k]
        for e, weights in provider.experts(self.layer, wanted):
            rows, cols = where[:, spans[e][0]:spans[e][1]]
            slots[rows, cols] = self.expert(x[rows], weights, w[rows, cols])
        return self._combine(slots, self._shared(x))

    def _batched(self, provider: ExpertProvider) -> bool:
        """Native numerics with the experts in the provider's arena: then all (token, choice)
        cells of a call go through the backend's fp4_moe at once instead of a per-expert loop (on
        CUDA about 20 launches per expert, hundreds of experts per layer), when every expert is
        resident or the cache can hold the call's experts at once (`acquire`: each is read once
        per call, prefill's chunk included). The choice does not depend on the device, so the CPU
        reference runs the same dispatch."""
        return self.numerics.batched_experts and provider.arena is not None

    def _arena_cells(self, x: torch.Tensor, w: torch.Tensor, cells: Cells, arena, groups: list) -> torch.Tensor:
        """Every (token, choice) cell [N·k] in one fp4_moe call (`_routed_cells`), summed per
        token where they lie (`Cells.rows`) with the shared expert; the same per-cell math as
        `decode`. Every expert of the call must be resident (and held while this enqueues its kernels)."""
        return self.numerics.moe_combine(self._routed_cells(x, w, cells, arena, groups), self._shared(x), cells.rows)

    def _routed_cells(self, x: torch.Tensor, w: torch.Tensor, cells: Cells, arena, groups: list,
                      table: torch.Tensor | None = None) -> torch.Tensor:
        """Every (token, choice) cell [N·k] in one fp4_moe call, cells grouped by expert (`cells.order`)
        with their `groups` (`Cells.groups`, `Cells.all_groups`: [] for the grouped GEMV), each
        expert read from its slot in `table` (default `arena.table`) -> [N·k, D] bf16 in that order."""
        k = cells.shape[1]
        order = cells.order
        table = arena.table if table is None else table
        slots = table[self.layer].index_select(0, cells.sorted_ids)  # [N·k] int32
        return self.numerics.backend.fp4_moe(x, arena.data, arena.record.fields, slots,
                                             w.reshape(-1).index_select(0, order), self.limit, groups,
                                             order // k)  # each token quantised once

    def decode(self, x: torch.Tensor | Quantized, routed: tuple[torch.Tensor, torch.Tensor], arena,
               lanes: Lanes) -> MoEParts:
        """One token x [1, D] (native: may carry its FP8 quantisation, which the shared and the
        routed experts then share) with its route ([1, k] ids, [1, k] weights) -> its output's
        parts (routed [1, k, D], shared [1, D]; `MoEParts.combine` sums them), no host sync.

        Experts are read from `arena` (engine.experts.arena.ExpertArena: `data` [slots, R] u8,
        `table` [units, E] int32 slot per (layer, expert), `record.fields`); every routed expert
        of this layer must be resident. The shared expert runs on `lanes`' side lane, beside the
        routed ones (engine/lanes.py). Equals `__call__`: same per-expert math, same order."""
        idx, w = routed
        xq = self.numerics.quantize(x)  # native: one row for all k choices
        with lanes.side():
            shared = self._shared(xq)
        # in one lane the shared expert's launches come first, and they write neither the ids nor
        # the arena: the routed kernels may then read those before their predecessor completes;
        # forked, their predecessor is the router's
        y = self.numerics.arena_experts(xq, arena, self.layer, idx, w, self.limit,
                                        early=not lanes.forks)  # [k, D], row j = choice j
        lanes.join()
        return MoEParts(self.numerics, y.unsqueeze(0), shared)  # [1, k, D]

    def chunk(self, x: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor], arena, table: torch.Tensor,
              lanes: Lanes) -> MoEParts:
        """A chunk step's token slots x [N, D] with their routes ([N, k] ids and weights) -> the
        output's parts (cells with their rows, shared [N, D]), no host sync: every cell in one
        `fp4_moe` call from `arena`, each expert read from its slot in `table` ([units, E] int32,
        every entry a slot of the arena: the runner's copy of `arena.table` with a slot for the
        experts not resident, so that a step guessed whole reads a wrong record, never outside
        the arena; engine/decode_graph.py), the shared expert on `lanes`' side lane. With no more
        experts than cells, each expert is read once for its run of N cells (`ExpertRuns`); else
        each cell reads its expert, scheduled from the device counts (`Cells.static`). Equals
        `__call__` when every routed expert is resident."""
        idx, w = routed
        experts = table.shape[1]
        with lanes.side():
            shared = self._shared(x)
        if experts > idx.numel():
            cells = Cells(idx, experts)
            y = self._routed_cells(x, w, cells, arena, cells.all_groups(table[self.layer]), table)
            rows = cells.rows
        else:
            runs = ExpertRuns(idx, experts)
            slots = table[self.layer].repeat_interleave(runs.run)  # [E·N] int32
            y = self.numerics.backend.fp4_moe(x, arena.data, arena.record.fields, slots, runs.spread(w), self.limit, [],
                                              runs.tokens, runs.run)  # [E·N, D] bf16
            rows = runs.rows
        lanes.join()
        return MoEParts(self.numerics, y, shared, rows)

    def _combine(self, slots: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """Sum the (token, choice) cells [N, k, D] in routing order (independent of expert arrival
        order), then the shared expert's output [N, D]; rounded once into the stream dtype."""
        return self.numerics.moe_combine(slots, shared)

    def expert(self, x: torch.Tensor, e: ExpertWeights, weight: torch.Tensor) -> torch.Tensor:
        """One routed expert on its tokens: the routing weight scales h before w2 (§C.7 step 4)."""
        return self.numerics.routed_expert(x, e, weight, self.limit)

    def _shared(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """The shared expert on x [N, D]: native -> bf16 (w1|w3 in one FP8 GEMM, on x's
        quantisation when it carries one; SwiGLU fused with w2's activation quantisation),
        exact -> fp32 (`Numerics.shared_expert`)."""
        return self.numerics.shared_expert(self.shared, x, self.limit)


@dataclass(frozen=True)
class MoEParts:
    """A MoE layer's output before its sum, for a consumer that sums it itself (the mHC post of
    the decode and chunk steps: `HyperConnection.moe_post_pre`, one launch fewer on CUDA):
    routed [N, k, D] in routing order, or cells [G, D] with `rows` [N, k] int64 (where each
    (token, choice) cell is), and the shared expert's shared [N, D]."""

    numerics: Numerics
    routed: torch.Tensor
    shared: torch.Tensor
    rows: torch.Tensor | None = None

    def combine(self) -> torch.Tensor:
        """The output [N, D]: the routed cells summed in routing order, then shared, rounded once
        into the numerics' dtype (`Numerics.moe_combine`)."""
        return self.numerics.moe_combine(self.routed, self.shared, self.rows)


class Cells:
    """The (token, choice) cells of a routed call, grouped by expert on the device (no host sync).

    idx [N, k] expert ids of `experts` per layer -> `order` [N·k] int64 (the cells sorted by
    expert id, stable), `sorted_ids` [N·k] (their experts), `counts` [experts] int32 (cells per
    expert), `rows` [N, k] int64 (where each (token, choice) cell is in that order)."""

    def __init__(self, idx: torch.Tensor, experts: int):
        self.shape = tuple(idx.shape)
        self.experts = experts
        flat = idx.reshape(-1)
        # the narrowest key a radix sort can take: one pass per key byte (8 for int64 ids)
        keys = flat.to(torch.uint8 if experts <= 256 else torch.int32)
        self.order = torch.argsort(keys, stable=True)
        self.sorted_ids = flat.index_select(0, self.order)
        self.rows = torch.empty_like(self.order).index_copy_(
            0, self.order, torch.arange(flat.shape[0], device=idx.device)).view(self.shape)
        self.counts = torch.zeros(experts, dtype=torch.int32, device=idx.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))

    @staticmethod
    def static(cells: int, experts: int) -> bool:
        """Whether `cells` cells over a layer of `experts` experts are scheduled without a host
        sync (`all_groups`): the grouped GEMV (too few cells for the tensor cores), or one group."""
        return experts <= EXPERTS_PER_DEQUANT or not dense(cells, experts)

    @property
    def one_group(self) -> bool:
        """The layer's experts fit one group of the tensor cores' path (`all_groups`): the cells
        need no host sync to be scheduled."""
        return self.experts <= EXPERTS_PER_DEQUANT

    def all_groups(self, slots: torch.Tensor) -> list:
        """The cells' schedule from the device counts alone (`one_group`): one group of every
        expert of the layer, `slots` [experts] (the layer's slot table row), when there are
        enough cells per expert for the tensor cores (kernels/fp4_moe.py `dense`; an expert
        without cells is an empty span, its dequantisation wasted, rare at this many cells each),
        else [] (the grouped GEMV)."""
        n, k = self.shape
        if not dense(n * k, self.experts):
            return []
        return [(0, n * k, slots, self.counts.cumsum(0, dtype=torch.int32))]

    def groups(self, counts: list[int], slots: list[int]) -> list:
        """The groups of the experts with cells (`counts` read on the host, `slots` theirs in id
        order), or [] when they have too few cells each for the tensor cores."""
        used = [c for c in counts if c]
        if not dense(sum(used), len(used)):
            return []
        spans, start = [], 0
        for slot, c in zip(slots, used):
            spans.append((slot, start, c))
            start += c
        return expert_groups(spans, self.counts.device)


class ExpertRuns:
    """The (token, choice) cells of a call laid out as one run of N cells per expert of the layer
    (no host sync): a token routes to an expert at most once, so an expert has at most N = the
    call's tokens cells. idx [N, k] expert ids of `experts` -> `run` = N; `rows` [N, k] int64,
    cell (n, j) at e·N + (tokens before n routed to e), e = idx[n, j]; `tokens` [E·N] int64, the
    token of each run cell (0 in the unused cells, whose routing weights `spread` leaves 0: they
    compute a zero output that no token reads)."""

    def __init__(self, idx: torch.Tensor, experts: int):
        n, k = idx.shape
        self.run = n
        routed = torch.zeros(n, experts, dtype=torch.int64, device=idx.device).scatter_(1, idx, 1)  # token n -> e
        before = routed.cumsum(0) - routed  # [N, E] tokens before n routed to e
        self.rows = idx * n + before.gather(1, idx)  # [N, k]
        token = torch.arange(n, device=idx.device).unsqueeze(1).expand(n, k)
        self.tokens = torch.zeros(experts * n, dtype=torch.int64, device=idx.device).index_copy_(
            0, self.rows.reshape(-1), token.reshape(-1))

    def spread(self, w: torch.Tensor) -> torch.Tensor:
        """Per-cell values w [N, k] -> [E·N] at their run cells, 0 in the unused ones."""
        return w.new_zeros(self.tokens.shape[0]).index_copy_(0, self.rows.reshape(-1), w.reshape(-1))

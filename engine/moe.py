"""Mixture of experts of one layer (spec §C.7): routing, routed experts, shared expert.

Routed-expert weights are not held here: the MoE asks an `ExpertProvider`
(engine/experts/provider.py) for the experts a call needs, and the provider may hand them over in
any order (resident hits first, then misses as they arrive). Each expert's output is written to
its (token, slot) cell and the slots are summed in routing order at the end, so the result does
not depend on that order. In native numerics, when the provider's arena holds every expert of a
call (all resident, or held for the call by `acquire`), all its cells go through one `fp4_moe`
call instead (`MoE._arena_cells`), on any device.
"""

from __future__ import annotations


import torch

from engine.config import ModelArgs
from engine.experts.provider import ExpertProvider
from engine.experts.weights import ExpertWeights
from engine.numerics import Numerics, Quantized


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
        wanted = idx.unique().tolist()  # the layer's one host sync
        if provider.all_resident():
            provider.record(self.layer, wanted)  # usage and cache statistics
            return self._arena_cells(x, idx, w, provider)
        if not provider.can_acquire(len(wanted)):
            return self._expert_loop(x, idx, w, provider)
        provider.acquire(self.layer, wanted)  # every expert of the call read once, then held
        try:
            return self._arena_cells(x, idx, w, provider)
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

    def _arena_cells(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                     provider: ExpertProvider) -> torch.Tensor:
        """Every (token, choice) cell [N·k] in one fp4_moe call, cells sorted by slot so that
        consecutive groups read the same expert (L2 reuse); the same per-cell math as `decode`.
        Every expert of the call must be resident (and held while this enqueues its kernels)."""
        n, k = idx.shape
        arena = provider.arena
        slots = arena.table[self.layer].index_select(0, idx.reshape(-1))  # [N·k] int32
        order = torch.argsort(slots)
        tokens = torch.arange(n, device=x.device).repeat_interleave(k)[order]  # each sorted cell's token
        y = self.numerics.backend.fp4_moe(x.index_select(0, tokens), arena.data, arena.record.fields,
                                          slots[order], w.reshape(-1)[order], self.limit)  # [N·k, D] fp32
        cells = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, choice) order
        return self._combine(cells.view(n, k, -1), self._shared(x))

    def decode(self, x: torch.Tensor | Quantized, routed: tuple[torch.Tensor, torch.Tensor], arena) -> torch.Tensor:
        """One token x [1, D] (native: may carry its FP8 quantisation, which the shared and the
        routed experts then share) with its route ([1, k] ids, [1, k] weights) -> [1, D], no host sync.

        Experts are read from `arena` (engine.experts.arena.ExpertArena: `data` [slots, R] u8,
        `table` [units, E] int32 slot per (layer, expert), `record.fields`); every routed expert
        of this layer must be resident. Equals `__call__`: same per-expert math, same order."""
        idx, w = routed
        xq = self.numerics.quantize(x)  # native: one row for all k choices
        # the shared expert first: the routed kernels then follow launches that do not write
        # the ids, and may read them and their weights before those launches complete
        shared = self._shared(xq)
        y = self.numerics.arena_experts(xq, arena, self.layer, idx, w, self.limit)  # [k, D], row j = choice j
        return self._combine(y.unsqueeze(0), shared)  # [1, k, D]

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

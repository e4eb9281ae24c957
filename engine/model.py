"""DeepSeek-V4-Flash, top to bottom (spec §C): embedding -> 4 mHC streams -> N decoder blocks of
attention and MoE -> HCHead -> norm -> head; plus the MTP block (§C.8).

The model holds weights only. Per-sequence state (`engine.state.SequenceState`) and the source
of routed experts (`engine.experts.provider.ExpertProvider`) are passed into every forward call; no I/O
happens here. Weights come through `get(name) -> Tensor` in their official on-disk names and
formats (e.g. `TensorIndex.get`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import Attention
from engine.chunk_position import ChunkPosition
from engine.config import ModelArgs
from engine.decode_position import DecodePosition
from engine.lanes import Lanes
from engine.mhc import HyperConnection, HyperHead, MixedIn
from engine.experts.provider import ExpertProvider
from engine.moe import MoE, MoEParts
from engine.numerics import Numerics, Quantized, unquantized
from engine.prefill_position import PrefillPosition
from engine.routing_override import ForcedRouting
from engine.state import SequenceState, new_layer_state
from engine.weights import CountedWeights
from engine.linear import FP8Linear

GetTensor = Callable[[str], torch.Tensor]
# Optional observer of discrete choices: log(kind, layer, start, tensor) with kind "experts"
# ([S, k] routed experts), "indexer" ([S, index_topk] picks, -1 = none) or "indexer_scores".
SelectionLog = Callable[[str, int, int, torch.Tensor], None]
# Router lookahead hook: ahead(layer, MoE input before its norm [S, D], token ids [S], routed ids [S, k]).
Lookahead = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _section(timer, name: str):
    """`timer.section(name)` (e.g. engine.runtime.StepTimer) around a sub-block, if timed."""
    return nullcontext() if timer is None else timer.section(name)


class Block:
    """One decoder block (§C.2): mHC around attention, then mHC around the MoE."""

    def __init__(self, get: GetTensor, prefix: str, args: ModelArgs, layer: int, numerics: Numerics,
                 routing: ForcedRouting | None = None):
        """`routing`: experts forced from a trace for timing (engine/routing_override.py), or None."""
        self.layer, self.eps, self.norm = layer, args.norm_eps, numerics.rms_norm
        self.routing = routing if routing is not None and routing.forces(layer) else None
        self.norm_q = numerics.norm_quantized  # the attention's input feeds two FP8 linears
        self.hc_attn = HyperConnection(get(f"{prefix}.hc_attn_fn"), get(f"{prefix}.hc_attn_scale"),
                                       get(f"{prefix}.hc_attn_base"), args, numerics)
        self.hc_ffn = HyperConnection(get(f"{prefix}.hc_ffn_fn"), get(f"{prefix}.hc_ffn_scale"),
                                      get(f"{prefix}.hc_ffn_base"), args, numerics)
        self.attn_norm = get(f"{prefix}.attn_norm.weight").float()
        self.ffn_norm = get(f"{prefix}.ffn_norm.weight").float()
        self.attn = Attention(get, f"{prefix}.attn", args, layer, numerics)
        self.ffn = MoE(get, f"{prefix}.ffn", args, layer, numerics)

    def __call__(self, streams: torch.Tensor, ids: torch.Tensor, at: PrefillPosition, st, experts: ExpertProvider,
                 log: SelectionLog | None = None, timer=None, ahead: Lookahead | None = None) -> torch.Tensor:
        """The block on the tokens `ids` [S] at positions `at` (shared by the call's blocks).
        `ahead` (router lookahead) is called once this layer's route is known, before its experts run."""
        start = at.start
        x, post, comb = self.hc_attn.pre(streams)
        with _section(timer, "attention"):
            a = self.attn(self.norm_q(x, self.attn_norm, self.eps), at, st,
                          None if log is None else lambda kind, t: log(kind, self.layer, start, t))
        streams = self.hc_attn.post(a, streams, post, comb)
        h, post, comb = self.hc_ffn.pre(streams)
        x = self.norm(h, self.ffn_norm, self.eps)
        with _section(timer, "moe"):
            forced = None if self.routing is None else self.routing.prefill_ids(self.layer, start, x.shape[0])
            routed = self.ffn.route(x, ids, forced)
            if log is not None:
                log("experts", self.layer, start, routed[0])
            if ahead is not None:
                ahead(self.layer, h, ids, routed[0])
            f = self.ffn(x, ids, experts, routed)
        return self.hc_ffn.post(f, streams, post, comb)

    # One-token decode with static shapes and a device position (CUDA-graph capturable), split at
    # the routing decision so a streaming runner can load the chosen experts in between.
    def decode_attention(self, streams: torch.Tensor, ids: torch.Tensor, at: DecodePosition, st,
                         emitting: frozenset[int], lanes: Lanes, pre: MixedIn | None = None) -> DecodeCarry:
        """First half of the block for one token: mHC + attention + mHC pre of the FFN + route.
        `emitting`: the compression ratios whose window this token completes; `lanes`: where
        work off the step's chain runs (engine/lanes.py); `pre`: the attention's mHC pre of
        `streams` when the block before made it (`decode_ffn`'s `following`)."""
        x, post, comb = self.hc_attn.pre(streams) if pre is None else pre
        emit = self.attn.ratio in emitting
        a = self.attn.decode(self.norm_q(x, self.attn_norm, self.eps), at, st, emit, lanes)
        streams, (h, post, comb) = self.hc_attn.post_pre(a, streams, post, comb, self.hc_ffn)
        x = self.norm_q(h, self.ffn_norm, self.eps)  # native: quantised once for the shared and routed experts
        forced = None if self.routing is None else self.routing.decode_ids(self.layer)  # set before the step
        return DecodeCarry(streams, x, post, comb, self.ffn.route(unquantized(x), ids, forced), h)

    def chunk_attention(self, streams: torch.Tensor, at: ChunkPosition, st, lanes: Lanes,
                        pre: MixedIn | None = None) -> DecodeCarry:
        """First half of the block for a chunk step's token slots (engine/chunk_position.py):
        streams [size, n_hc, D], static shapes, the route of every slot; `pre` as in
        `decode_attention`."""
        x, post, comb = self.hc_attn.pre(streams) if pre is None else pre
        a = self.attn.chunk(self.norm_q(x, self.attn_norm, self.eps), at, st, lanes)
        streams, (h, post, comb) = self.hc_attn.post_pre(a, streams, post, comb, self.hc_ffn)
        x = self.norm(h, self.ffn_norm, self.eps)
        forced = None if self.routing is None else self.routing.chunk_ids(self.layer)  # set before the step
        return DecodeCarry(streams, x, post, comb, self.ffn.route(x, at.ids, forced), h)

    def chunk_ffn(self, carry: DecodeCarry, arena, table: torch.Tensor, lanes: Lanes,
                  following: HyperConnection | None = None) -> tuple[torch.Tensor, MixedIn | None]:
        """Second half of a chunk step: every slot's routed experts from the arena in one call,
        each read from its slot in `table` (`MoE.chunk`), the shared expert, mHC post -> streams
        [size, n_hc, D], and as `decode_ffn` the next block's mHC pre of them."""
        return self._post(self.ffn.chunk(carry.x, carry.routed, arena, table, lanes), carry, following)

    def decode_ffn(self, carry: DecodeCarry, arena, lanes: Lanes,
                   following: HyperConnection | None = None) -> tuple[torch.Tensor, MixedIn | None]:
        """Second half: routed experts from the arena + shared expert, mHC post -> (streams, the
        `following` block's attention mHC pre of them in the same op, None without one)."""
        return self._post(self.ffn.decode(carry.x, carry.routed, arena, lanes), carry, following)

    def _post(self, f: MoEParts, carry: DecodeCarry,
              following: HyperConnection | None) -> tuple[torch.Tensor, MixedIn | None]:
        if following is None:
            return self.hc_ffn.post(f.combine(), carry.streams, carry.post, carry.comb), None
        return self.hc_ffn.moe_post_pre(f.routed, f.shared, f.rows, carry.streams, carry.post, carry.comb, following)


@dataclass
class DecodeCarry:
    """What a block's decode passes from its attention half to its FFN half."""

    streams: torch.Tensor  # [1, n_hc, D] after the attention's mHC post ([size, ...] in a chunk step)
    x: torch.Tensor | Quantized  # [1, D] ffn-normed block input (native: with its FP8 quantisation)
    post: torch.Tensor
    comb: torch.Tensor
    routed: tuple[torch.Tensor, torch.Tensor]  # expert ids [1, k] int64, weights [1, k] fp32
    hidden: torch.Tensor  # [1, D] the MoE input before its norm (router lookahead, `Transformer.predict_next`)


class MTP:
    """The multi-token-prediction block `mtp.0` (§C.8): logical layer n_layers, window-only."""

    def __init__(self, get: GetTensor, args: ModelArgs, numerics: Numerics):
        p = "mtp.0"
        self.eps, self.numerics = args.norm_eps, numerics
        self.e_proj = FP8Linear(get(f"{p}.e_proj.weight"), get(f"{p}.e_proj.scale"), numerics)
        self.h_proj = FP8Linear(get(f"{p}.h_proj.weight"), get(f"{p}.h_proj.scale"), numerics)
        self.enorm, self.hnorm = get(f"{p}.enorm.weight").float(), get(f"{p}.hnorm.weight").float()
        self.norm = get(f"{p}.norm.weight").float()
        self.block = Block(get, p, args, args.n_layers, numerics)
        self.hc_head = HyperHead(get(f"{p}.hc_head_fn"), get(f"{p}.hc_head_scale"), get(f"{p}.hc_head_base"), args,
                                 numerics)


class Transformer:
    """The main model. `forward` runs S tokens of one sequence from `state.pos` on."""

    def __init__(self, get: GetTensor, args: ModelArgs, numerics: Numerics, with_mtp: bool = False,
                 routing: ForcedRouting | None = None, lookahead: bool = False):
        """`routing`: force the router-routed layers' experts from a trace, for timing only
        (engine/routing_override.py; a decode step must call `routing.set_position` first).
        `lookahead` (EngineConfig.lookahead_prefetch): once layer L routes, hand the provider
        layer L+1's predicted experts (`predict_next`) while the experts do not all fit."""
        self.args, self.numerics, self.routing, self.lookahead = args, numerics, routing, lookahead
        get = CountedWeights(get)
        self.embed = get("embed.weight")  # [V, D] bf16, looked up row by row
        self.blocks = [Block(get, f"layers.{i}", args, i, numerics, routing) for i in range(args.n_layers)]
        self.hc_head = HyperHead(get("hc_head_fn"), get("hc_head_scale"), get("hc_head_base"), args, numerics)
        self.norm = get("norm.weight").float()
        self.head = get("head.weight")  # [V, D] bf16: the official head runs in fp32 (widened per call)
        self.mtp = MTP(get, args, numerics) if with_mtp and args.n_mtp_layers else None
        self.weight_bytes = get.nbytes  # the resident weights read at load, as stored (engine/memory.py's census)

    def new_state(self) -> SequenceState:
        a, dt, dev = self.args, self.numerics.dtype, self.embed.device
        layers = [new_layer_state(a.window_size, a.head_dim, a.ratio(i), a.index_head_dim, dt, dev)
                  for i in range(a.n_layers)]
        mtp = new_layer_state(a.window_size, a.head_dim, 0, a.index_head_dim, dt, dev) if self.mtp else None
        return SequenceState(layers=layers, mtp=mtp)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids].to(self.numerics.dtype)

    def forward_streams(self, ids: torch.Tensor, state: SequenceState, experts: ExpertProvider,
                        log: SelectionLog | None = None, timer=None) -> torch.Tensor:
        """ids [S] -> final residual streams [S, n_hc, D]; advances state.pos by S.

        `timer.section(name)` (optional) times each block's "attention" and "moe"."""
        start = state.pos
        # hash layers' hints; none when every expert is resident (nothing to read early, and the
        # ids' copy to the host would wait for the device work queued before this call)
        hashed = [] if experts.all_resident() else [b for b in self.blocks if b.ffn.gate.hash]
        host_ids = ids.cpu() if hashed else None
        for block in hashed:  # hash layers know their experts from the token ids alone
            experts.prefetch(block.layer, sorted(set(block.ffn.gate.tid2eid_host[host_ids].flatten().tolist())))
        h = self.embed_tokens(ids)
        streams = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [S, n_hc, D]
        ahead = self._ahead(experts, start) if self.lookahead_active(experts) else None
        at = self.prefill_position(start, ids.shape[0], ids.device)
        for block, st in zip(self.blocks, state.layers):
            streams = block(streams, ids, at, st, experts, log, timer, ahead)
        state.pos = start + ids.shape[0]
        return streams

    def lookahead_active(self, experts: ExpertProvider) -> bool:
        """Router lookahead runs: asked for, and the provider streams (not every expert resident)."""
        return self.lookahead and experts.cache is not None and not experts.all_resident()

    def predict_next(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor,
                     start: int | None = None) -> torch.Tensor | None:
        """Router lookahead: layer+1's gate on `hidden` (layer's MoE input before its norm, [S, D])
        normed with layer+1's ffn_norm -> predicted expert ids [S, k] of layer+1 (no host sync);
        None when layer+1 is not a main layer routed by its router (hash layers are known from the
        token ids). A forced layer (timing only) gets the trace's stand-in guesses, if any, for
        positions start.. (start None: the current decode step's), engine/routing_override.py."""
        if layer + 1 >= len(self.blocks):
            return None
        nxt = self.blocks[layer + 1]
        if nxt.ffn.gate.hash:
            return None
        if nxt.routing is not None:
            return nxt.routing.lookahead_ids(layer + 1, start, ids.shape[0])
        return nxt.ffn.route(nxt.norm(hidden, nxt.ffn_norm, nxt.eps), ids)[0]

    def _ahead(self, experts: ExpertProvider, start: int) -> Lookahead:
        """The eager path's lookahead for a call from position `start`: layer L+1's predicted
        experts to the provider with L's route as `keep` (never evicted; the hint's reads queue
        after L's own, engine/experts/streaming.py)."""
        def ahead(layer: int, hidden: torch.Tensor, ids: torch.Tensor, routed: torch.Tensor) -> None:
            predicted = self.predict_next(layer, hidden, ids, start)
            if predicted is not None:
                experts.prefetch_predicted(layer + 1, sorted(set(predicted.flatten().tolist())),
                                           keep=[(layer, e) for e in sorted(set(routed.flatten().tolist()))])
        return ahead

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [S, n_hc, D] -> logits [S, V] fp32 (HCHead, norm, fp32 head)."""
        y = self.numerics.rms_norm(self.hc_head(streams), self.norm, self.args.norm_eps)
        return self._head(y)

    def _head(self, y: torch.Tensor) -> torch.Tensor:
        return self.numerics.head_logits(y, self.head)

    def forward(self, ids: torch.Tensor, state: SequenceState, experts: ExpertProvider,
                last_only: bool = False, log: SelectionLog | None = None, timer=None) -> torch.Tensor:
        """ids [S] -> logits [S, V] (or [1, V] with last_only) fp32."""
        streams = self.forward_streams(ids, state, experts, log, timer)
        return self.logits(streams[-1:] if last_only else streams)

    def reserve(self, state: SequenceState, pos: int) -> bool:
        """Room in every compressed layer for the entry of position `pos` (what a decode step at
        pos writes); True when some buffer was reallocated."""
        grown = False
        for i, st in enumerate(state.layers):
            if self.args.ratio(i):
                grown |= st.reserve(pos // self.args.ratio(i) + 1)
        return grown

    def decode_begin(self, ids: torch.Tensor) -> torch.Tensor:
        """Streams [1, n_hc, D] of one token id [1]."""
        return self.embed_tokens(ids).unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()

    def chunk_position(self, size: int, device: torch.device | str) -> ChunkPosition:
        """The static inputs of a chunk step of `size` token slots (`Block.chunk_attention`)."""
        return ChunkPosition(self.args.window_size, self.args.compress_ratios, size, device)

    def prefill_position(self, start: int, size: int, device: torch.device | str) -> PrefillPosition:
        """The index tensors an eager call of `size` tokens from `start` shares across its blocks."""
        return PrefillPosition(start, size, self.args.window_size, self.args.compress_ratios, device)

    def emitting(self, pos: int) -> frozenset[int]:
        """The compression ratios whose window the token at `pos` completes (it emits an entry):
        the one host-known fact a decode step's control flow depends on."""
        return frozenset(r for r in self.args.compress_ratios if r and (pos + 1) % r == 0)

    def decode_position(self, device: torch.device | str) -> DecodePosition:
        """The static position inputs of a decode step (`Block.decode_attention`) for this
        model's window and compression ratios."""
        return DecodePosition(self.args.window_size, self.args.compress_ratios, device)

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, start: int, state: SequenceState,
                    experts: ExpertProvider) -> torch.Tensor:
        """MTP logits: streams [S, n, D] of tokens at start.. and the following tokens `next_ids`
        [S] -> logits [S, V] predicting the token after next. Uses `state.mtp` (own window ring)."""
        m = self.mtp
        e = self.numerics.rms_norm(self.embed_tokens(next_ids), m.enorm, m.eps)
        hs = self.numerics.rms_norm(streams, m.hnorm, m.eps)  # per stream
        s, n, d = hs.shape
        x = m.h_proj(hs.reshape(s * n, d)).view(s, n, d) + m.e_proj(e).unsqueeze(1)  # [S, n, D]
        at = self.prefill_position(start, s, x.device)
        x = m.block(x.to(self.numerics.dtype), next_ids, at, state.mtp, experts)
        y = self.numerics.rms_norm(m.hc_head(x), m.norm, self.args.norm_eps)
        return self._head(y)

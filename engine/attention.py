"""Attention of one DeepSeek-V4 layer (spec §C.4–§C.6): sliding window + compressed branch.

Every call processes S consecutive tokens of one sequence at absolute positions
start..start+S-1 (prefill, a prefill chunk, or one decode token) against the per-sequence
`LayerState`; the result is the same whatever the chunking.
"""

from __future__ import annotations

import torch

from engine.chunk_position import ChunkPosition
from engine.config import ModelArgs
from engine.decode_position import DecodePosition
from engine.lanes import Lanes
from engine.linear import FP8Linear, FP8Linears, GroupedOutProj
from engine.numerics import Numerics, unquantized
from engine.prefill_position import PrefillPosition
from engine.state import CompressorState, LayerState
from kernels import reference as ref


class Rope:
    """A layer's RoPE: θ=rope_theta for ratio-0 layers, compress_rope_theta + YaRN else.

    The numerics rotate: native through the backend (one launch on CUDA, angles computed in the
    kernel), exact by a (cos, sin) table computed once per call of the layer."""

    def __init__(self, args: ModelArgs, compressed: bool, numerics: Numerics, device: torch.device):
        yarn = None
        if compressed:
            yarn = {"factor": args.rope_factor, "original_seq_len": args.original_seq_len,
                    "beta_fast": args.beta_fast, "beta_slow": args.beta_slow}
        theta = args.compress_rope_theta if compressed else args.rope_theta
        self.numerics = numerics
        self.inv_freq = ref.rope_inv_freq(args.rope_head_dim, theta, yarn).to(device)

    def table(self, positions: torch.Tensor):
        """What rotating several tensors at `positions` [S] needs once (`Numerics.rope_table`)."""
        return self.numerics.rope_table(positions, self.inv_freq)

    def __call__(self, x: torch.Tensor, at, inverse: bool = False) -> torch.Tensor:
        """Rotate x at `at`: positions [S], or a `table` of them."""
        return self.numerics.rope(x, at, self.inv_freq, inverse)

    def normed(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, at, round_lead: int = 0,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """RMSNorm of x (weight or None), then rotated at `at`; native also QDQ8-rounds the leading
        `round_lead` channels (KV storage; exact has no storage rounding). Native: one backend op.
        `out` = (buffer, rows): token s is written to buffer[rows[s]] instead (None returned)."""
        return self.numerics.norm_rope(x, weight, eps, at, self.inv_freq, round_lead, out)


class Compressor:
    """Gated pooling of every r tokens into one entry (§C.5); overlap scheme when r = 4.

    `kind` "attention" (d = head_dim; QDQ8 of the nope dims in native) or "indexer"
    (d = index_head_dim; Hadamard + QDQ4 in native).
    """

    def __init__(self, get, prefix: str, args: ModelArgs, ratio: int, dim: int, kind: str,
                 rope: Rope, numerics: Numerics):
        self.ratio, self.dim, self.kind, self.rope, self.numerics = ratio, dim, kind, rope, numerics
        self.overlap = ratio == 4
        self.w = numerics.compressor_weight(get(f"{prefix}.wkv.weight"), get(f"{prefix}.wgate.weight"))
        self.ape = get(f"{prefix}.ape").float()  # [r, c·d]
        self.norm = get(f"{prefix}.norm.weight").float()
        self.eps = args.norm_eps
        self.rope_dim = args.rope_head_dim

    def __call__(self, x: torch.Tensor, at: PrefillPosition, st: CompressorState) -> None:
        """Project x [S, D] at positions `at`, emit every completed window into st.entries."""
        r, start = self.ratio, at.start
        kv, gate = self._project(x)  # [S, c·d] fp32 each
        gate = gate + self.ape.index_select(0, at.ape_row[r])
        n_buf = start % r  # tokens of the open window seen before this call
        if n_buf:  # (a call at a window boundary has none: no copy)
            kv = torch.cat((st.buf_kv[:n_buf], kv))
            gate = torch.cat((st.buf_gate[:n_buf], gate))
        n_win = at.n_windows(r)
        rest = kv.shape[0] - n_win * r
        st.buf_kv[:rest] = kv[n_win * r:]
        st.buf_gate[:rest] = gate[n_win * r:]
        if n_win == 0:
            return
        # the completed windows [n_win, r, c·d] pooled (an overlap compressor's prev takes the last
        # one's first halves), normed and rotated at their first positions: one launch each on CUDA
        win = (n_win, r, kv.shape[1])
        pooled = self.numerics.compressor_pool(kv[:n_win * r].view(win), gate[:n_win * r].view(win), st.prev_kv,
                                               st.prev_gate)
        st.store_entries(at.first_window(r), self._stored(pooled, at.window_pos[r]))

    def decode(self, x: torch.Tensor, at: DecodePosition, st: CompressorState, emit: bool) -> None:
        """One token x [1, D] at decode position `at`, with static shapes (no host sync).

        The token goes to buffer row p mod r. `emit` (the caller knows the position on the
        host: (p + 1) % r == 0) says that it completes its window: then the window is pooled
        into entry p // r, and an overlap compressor keeps the window's first half."""
        r = self.ratio
        row, entry = at.row[r], at.entry[r]
        self.numerics.compressor_project_rows(self.w, x, self.ape, row, st.buf_kv, st.buf_gate)  # one launch on CUDA
        if not emit:
            return
        # the window pooled (an overlap compressor's prev takes its first halves), then normed and
        # rotated at its first position into its entry row: one launch each on CUDA
        pooled = self.numerics.compressor_pool(st.buf_kv.unsqueeze(0), st.buf_gate.unsqueeze(0), st.prev_kv,
                                               st.prev_gate)  # [1, d]
        self._stored(pooled, at.first[r], out=(st.entries, entry))

    def chunk(self, x: torch.Tensor, at: ChunkPosition, st: CompressorState) -> None:
        """A chunk step's token slots x [size, D] (engine/chunk_position.py), with static shapes
        (no host sync): every window the chunk's real tokens complete is pooled into its entry,
        and the open window's rows (and an overlap compressor's previous first half) are those
        after the chunk. Equals `__call__` on the real tokens."""
        r = self.ratio
        kv, gate = self._project(x)
        kv_rows = torch.cat((st.buf_kv, kv))  # [r + size, c·d]: the open window's rows, then the chunk's
        gate_rows = torch.cat((st.buf_gate, gate + self.ape.index_select(0, at.ape_row[r])))
        win_kv, win_gate = kv_rows[at.win_src[r]], gate_rows[at.win_src[r]]  # [nw, r, c·d]
        if self.overlap:
            d = self.dim
            prev_kv = torch.cat((st.prev_kv, kv_rows[:, :d]))  # [r + r + size, d]
            prev_gate = torch.cat((st.prev_gate, gate_rows[:, :d]))
            win_kv = torch.cat((prev_kv[at.prev_src[r]], win_kv[:, :, d:]), dim=1)  # [nw, 2r, d]
            win_gate = torch.cat((prev_gate[at.prev_src[r]], win_gate[:, :, d:]), dim=1)
            st.prev_kv.copy_(prev_kv[at.prev_next[r]])
            st.prev_gate.copy_(prev_gate[at.prev_next[r]])
        st.buf_kv.copy_(kv_rows[at.buf_src[r]])
        st.buf_gate.copy_(gate_rows[at.buf_src[r]])
        st.entries.index_copy_(0, at.entry[r], self._pool(win_kv, win_gate, at.entry[r] * r))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, D] -> (kv, gate logits without ape) [S, c·d], fp32 products of the bf16 weights."""
        return self.numerics.compressor_project(self.w, x)

    def _pool(self, win_kv: torch.Tensor, win_gate: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Gated pooling of windows [n_win, slots, d] whose first positions are `first` [n_win]
        (entry · ratio: where each is rotated) -> stored entries."""
        return self._stored(ref.pool_windows(win_kv, win_gate).to(self.numerics.dtype), first)

    def _stored(self, pooled: torch.Tensor, first: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Pooled entries [n, d] (numerics dtype) whose first positions are `first` [n] -> normed
        and rotated there, with native's storage rounding: QDQ8 of the nope dims (attention
        keys) or Hadamard + QDQ4 (indexer keys). `out` = (entries, rows): entry i is written to
        entries[rows[i]] instead and None returned (attention keys straight from the norm)."""
        if self.kind == "attention":
            return self.rope.normed(pooled, self.norm, self.eps, first, self.dim - self.rope_dim, out=out)
        entries = self.numerics.round_index(self.rope.normed(pooled, self.norm, self.eps, first))
        if out is None:
            return entries
        out[0].index_copy_(0, out[1], entries)
        return None


class Indexer:
    """Lightning indexer of CSA layers (§C.6): scores visible entries, keeps the top-k."""

    def __init__(self, get, prefix: str, args: ModelArgs, rope: Rope, numerics: Numerics):
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.ratio, self.rope, self.numerics = 4, rope, numerics
        self.wq_b = FP8Linear(get(f"{prefix}.wq_b.weight"), get(f"{prefix}.wq_b.scale"), numerics)
        self.weights_proj = numerics.float_weight(get(f"{prefix}.weights_proj.weight"))
        self.compressor = Compressor(get, f"{prefix}.compressor", args, 4, args.index_head_dim, "indexer",
                                     rope, numerics)

    def __call__(self, x: torch.Tensor, c, at: PrefillPosition, st: CompressorState, log=None,
                 rot=None) -> torch.Tensor:
        """Selected attention-compressor entries per query at `at`: [S, index_topk] int64, -1 = none.

        `c` is the attention's q_lora activation (a `Quantized` one in native numerics);
        `log(scores)` sees the masked index scores [S, n_entries] (tests explain tie flips);
        `rot` is the queries' RoPE table if the caller has it."""
        self.compressor(x, at, st)
        visible = at.visible[self.ratio]  # entries w < visible are complete at p
        scores = self._scores(self.queries(c, at.pos, rot), self.weights(x), visible,
                              st.entries[:at.n_entries(self.ratio)])
        if log is not None:
            log(scores)
        return self._select(scores, visible)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """The heads' weights [S, IH] fp32 of the block inputs x [S, D] (the scores weigh each
        head's by them)."""
        return self.numerics.indexer_weights(x, self.weights_proj, self.n_heads ** -0.5)

    def picks(self, q: torch.Tensor, w: torch.Tensor, at: DecodePosition | ChunkPosition, st: CompressorState,
              n_keys: int, window_rows: torch.Tensor, offset: int) -> torch.Tensor:
        """A decode or chunk step's key rows [S, W + index_topk]: `window_rows` [S, W], then the
        top `index_topk` of the first `n_keys` (static) entry slots, scored by the index queries
        q (`queries`) with head weights w (`weights`), at `offset` + slot where visible at `at`
        and -1 elsewhere (not yet visible slots score -inf, so the picks equal `__call__`'s),
        -1 padded (`Numerics.index_picks`: one launch after the scores on CUDA). The step's keys
        must be in `st.entries` already (`Compressor.decode` / `chunk` on the same inputs)."""
        visible = at.visible[self.ratio]
        scores = self._scores(q, w, visible, st.entries[:n_keys])
        return self.numerics.index_picks(scores, window_rows, visible, min(self.topk, n_keys), offset, self.topk)

    def queries(self, c, positions: torch.Tensor, rot=None) -> torch.Tensor:
        """The index queries [S, IH, ID] of the q_lora activation `c` at `positions`: wq_b
        (`project`), RoPE (`rot`: the caller's table, if it has one), Hadamard + QDQ4 (one launch
        each on CUDA)."""
        return self.rotated(self.project(c), positions, rot)

    def project(self, c) -> torch.Tensor:
        """`queries`' first step: wq_b of the q_lora activation c -> [S, IH, ID]."""
        q = self.wq_b(c)
        return q.view(q.shape[0], self.n_heads, self.head_dim)

    def rotated(self, q: torch.Tensor, positions: torch.Tensor, rot=None) -> torch.Tensor:
        """`queries`' rest: RoPE and Hadamard + QDQ4 of projected queries q [S, IH, ID]."""
        return self.numerics.round_index(self.rope(q, positions if rot is None else rot))

    def _scores(self, q: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [S, T] of queries q [S, IH, ID] (`queries`) over keys [T, ID]; -inf for
        entries at or after `visible` [S] (the count complete at each query)."""
        return self.numerics.indexer_scores(q, keys, w, visible, self.head_dim ** -0.5)

    def _select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Top `index_topk` visible entries per query, -1 for absent ones (fixed width)."""
        s, n = scores.shape
        k = min(self.topk, n)
        top = ref.topk_desc(scores, k)
        top = torch.where(top >= visible.unsqueeze(1), -1, top)
        if k < self.topk:
            top = torch.cat((top, top.new_full((s, self.topk - k), -1)), dim=1)
        return top


def _ring_rows(ring: torch.Tensor, first: int, n: int) -> list[torch.Tensor]:
    """The rows of positions first..first+n-1 (n <= W) of a ring [W, ...] whose slot p mod W
    holds position p: one or two slices (views), in position order."""
    w = ring.shape[0]
    a = first % w
    return [ring[a:a + n]] if a + n <= w else [ring[a:], ring[:a + n - w]]


class Attention:
    """Query/KV projections, window + compressed keys, one softmax with sink, grouped output."""

    def __init__(self, get, prefix: str, args: ModelArgs, layer: int, numerics: Numerics):
        self.args, self.numerics = args, numerics
        self.ratio = args.ratio(layer)
        self.n_heads, self.head_dim, self.window = args.n_heads, args.head_dim, args.window_size
        self.sink = get(f"{prefix}.attn_sink").float()
        self.rope = Rope(args, self.ratio > 0, numerics, self.sink.device)  # tables live with the weights
        wq_a = (get(f"{prefix}.wq_a.weight"), get(f"{prefix}.wq_a.scale"))
        wkv = (get(f"{prefix}.wkv.weight"), get(f"{prefix}.wkv.scale"))
        # x's two readers: native stacks them into one GEMV, rows [wq_a; wkv], when wq_a's rows
        # fill whole 128-row blocks (`Numerics.fp8_groups`)
        self.wq_a_kv = FP8Linears([wq_a, wkv], numerics)
        self.q_norm = get(f"{prefix}.q_norm.weight").float()
        # wq_b and the indexer's wq_b (both read c) as one GEMV: measured and not adopted, the
        # graphed decode step did not move (docs/performance-log.md, 2026-12-01).
        self.wq_b = FP8Linear(get(f"{prefix}.wq_b.weight"), get(f"{prefix}.wq_b.scale"), numerics)
        self.kv_norm = get(f"{prefix}.kv_norm.weight").float()
        self.wo_a = GroupedOutProj(get(f"{prefix}.wo_a.weight"), get(f"{prefix}.wo_a.scale"), args.o_groups,
                                   numerics)
        self.wo_b = FP8Linear(get(f"{prefix}.wo_b.weight"), get(f"{prefix}.wo_b.scale"), numerics)
        self.compressor = self.indexer = None
        self._slot_ids: torch.Tensor | None = None  # see _slots
        if self.ratio:
            self.compressor = Compressor(get, f"{prefix}.compressor", args, self.ratio, args.head_dim,
                                         "attention", self.rope, numerics)
        if self.ratio == 4:
            self.indexer = Indexer(get, f"{prefix}.indexer", args, self.rope, numerics)

    def __call__(self, x: torch.Tensor, at: PrefillPosition, st: LayerState, log=None) -> torch.Tensor:
        """x [S, D] (attn-normed) at positions `at` -> [S, D].

        `log(kind, tensor)` sees the indexer's scores ("indexer_scores") and picks ("indexer").
        x may carry its FP8 quantisation (`Numerics.norm_quantized`)."""
        xq, x = x, unquantized(x)
        rot = self.rope.table(at.pos)
        c, q, kv = self._project(xq, rot)
        kv = kv.to(st.window.dtype)
        # the keys: the ring's tokens before the call, the new ones, then the entries (written
        # by the compressor first); one copy, taken before the ring takes the new tokens
        parts = _ring_rows(st.window, at.start - at.n_prev, at.n_prev) + [kv]
        idx = at.window_rows
        if self.ratio:
            n_entries = at.n_entries(self.ratio)
            st.reserve(n_entries)
            self.compressor(x, at, st.compressor)
            if self.indexer is not None:
                chosen = self.indexer(x, c, at, st.indexer,
                                      None if log is None else lambda t: log("indexer_scores", t), rot)
                if log is not None:
                    log("indexer", chosen)
                idx = torch.cat((idx, torch.where(chosen >= 0, chosen + at.window_keys, chosen)), dim=1)
            else:
                idx = at.all_rows(self.ratio)
            parts.append(st.compressor.entries[:n_entries])
        keys = torch.cat(parts)
        self._update_ring(kv, at, st)
        return self._output(self._attend(q, keys, idx, rot))

    def decode(self, x: torch.Tensor, at: DecodePosition, st: LayerState, emit: bool, lanes: Lanes) -> torch.Tensor:
        """One token x [1, D] at decode position `at` -> [1, D], with static shapes.

        Keys are read in place from `st.kv` (ring rows in position order, then entry slots
        0..capacity-1 with -1 for those not visible), so the call is CUDA-graph capturable; the
        caller reserves room for entry p // ratio first and says whether the token completes a
        compression window (`emit`, from the host position: `Transformer.emitting`). The
        compressors, the indexer's scores and the key selection run on `lanes`' side lanes,
        beside the query projections (`_keys_beside`). Equals `__call__`."""
        xq, x = x, unquantized(x)  # x may carry its FP8 quantisation (`Numerics.norm_quantized`)
        rot = self.rope.table(at.pos)
        idx, w = self._keys_beside(x, at.window_rows, at, st, lanes, self.window,
                                   lambda: self.compressor.decode(x, at, st.compressor, emit),
                                   lambda: self.indexer.compressor.decode(x, at, st.indexer, emit))
        c, kv = self._query_lora(xq)
        if self.indexer is not None:
            iq = self.indexer.project(c)  # lane 0 reads it: held here until the join
            idx = self._picks_beside(iq, rot, w, idx, at, st, lanes, self.window)
        q, _ = self._queries(c, kv, rot, kv_out=(st.window, at.window_row))  # kv straight into its row
        lanes.join()
        return self._output(self._attend(q, st.kv, idx, rot))

    def chunk(self, x: torch.Tensor, at: ChunkPosition, st: LayerState, lanes: Lanes) -> torch.Tensor:
        """A chunk step's token slots x [size, D] (engine/chunk_position.py) -> [size, D], with
        static shapes (no host sync): the keys are gathered from the chunk's new keys and
        `st.kv` (after the compressors have written the entries the chunk completes), then the
        ring takes the real tokens' keys. The compressors and the indexer run on `lanes`' side
        lanes, as in `decode`. Equals `__call__` on the real tokens."""
        xq, x = x, unquantized(x)
        rot = self.rope.table(at.pos)
        idx, w = self._keys_beside(x, at.window_rows, at, st, lanes, at.entry_offset,
                                   lambda: self.compressor.chunk(x, at, st.compressor),
                                   lambda: self.indexer.compressor.chunk(x, at, st.indexer))
        c, kv = self._query_lora(xq)
        if self.indexer is not None:
            iq = self.indexer.project(c)  # lane 0 reads it: held here until the join
            idx = self._picks_beside(iq, rot, w, idx, at, st, lanes, at.entry_offset)
        q, kv = self._queries(c, kv, rot)
        lanes.join()
        keys = torch.cat((kv.to(st.kv.dtype), st.kv))  # [size + W + capacity, D]
        st.window.copy_(keys[at.ring_src])
        return self._output(self._attend(q, keys, idx, rot))

    # A static step's keys beside its chain of kernels (engine/lanes.py): in a CSA layer the
    # indexer's head weights and keys, then (once the chain has made c and, right after it, the
    # index queries' projection) the queries' RoPE and rounding, scores and picks run on side
    # lane 0, and the attention's compressor on lane 1, so the picks do not wait for the
    # attention's keys nor the chain for the index scores; in an HCA layer the compressor and the
    # key rows (every entry slot) run on lane 0.
    def _keys_beside(self, x: torch.Tensor, window_rows: torch.Tensor, at, st: LayerState, lanes: Lanes,
                     offset: int, compress, compress_index) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queue the step's compressors (`compress`; the indexer's `compress_index`) on the side
        lanes -> (key rows so far [S, ...]: an HCA layer's whole rows, else `window_rows`; the
        indexer's head weights [S, IH] or None)."""
        if not self.ratio:
            return window_rows, None
        if self.indexer is None:
            with lanes.side(0):  # they read x alone
                compress()
                slots = self._slots(st.capacity, window_rows.device).expand(window_rows.shape[0], -1)
                return self._key_rows(window_rows, slots, at.visible[self.ratio], st.capacity, offset), None
        with lanes.side(0):  # the indexer's head weights and keys: they read x alone
            w = self.indexer.weights(x)  # first: one small launch, before the chain's GEMVs fill the GPU
            compress_index()
        with lanes.side(1):  # the attention's keys, read by the attention alone
            compress()
        return window_rows, w

    def _picks_beside(self, iq: torch.Tensor, rot, w: torch.Tensor, window_rows: torch.Tensor, at, st: LayerState,
                      lanes: Lanes, offset: int) -> torch.Tensor:
        """On side lane 0, after the indexer's head weights w and keys, from the index queries'
        projection iq [S, IH, ID] (`Indexer.project`, which the caller runs on the chain right
        after c: its weight loads overlap the q norm, and the lane does not wait for SM room
        behind the attention's wq_b): their RoPE and rounding, and the key rows (the window's,
        then the top index_topk visible entries) -> [S, W + index_topk]. The caller holds iq and
        the RoPE table `rot` until the join (engine/lanes.py: freed earlier, the chain's next
        allocation could take iq's memory while the lane still reads it)."""
        with lanes.side(0):
            q = self.indexer.rotated(iq, at.pos, rot)
            return self.indexer.picks(q, w, at, st.indexer, st.capacity, window_rows, offset)

    def _key_rows(self, window_rows: torch.Tensor, order: torch.Tensor, visible: torch.Tensor, width: int,
                  offset: int) -> torch.Tensor:
        """A static step's key rows: the window's rows, then the first `width` entry slots of
        `order` (best first) that are visible, at `offset` + slot, -1 padded (one launch on CUDA)."""
        return self.numerics.sparse_index(window_rows, order, visible, min(width, order.shape[1]), offset, width)

    def _slots(self, n: int, device: torch.device) -> torch.Tensor:
        """[1, n] entry slots 0..n-1, made once per size (decode steps reuse them)."""
        if self._slot_ids is None or self._slot_ids.shape[1] != n:
            self._slot_ids = torch.arange(n, device=device).unsqueeze(0)
        return self._slot_ids

    def _project(self, x: torch.Tensor, rot) -> tuple:
        """(c [S, q_lora_rank] (native: `Quantized`, for the two FP8 linears that read it), q [S, H, D]
        normed + roped, kv [S, D] roped, storage-rounded); `rot` = the tokens' RoPE table."""
        c, kv = self._query_lora(x)
        q, kv = self._queries(c, kv, rot)
        return c, q, kv

    def _query_lora(self, x: torch.Tensor) -> tuple:
        """x [S, D] (attn-normed; may carry its quantisation) -> (c, the q_lora activation after
        q_norm (native: `Quantized`, read by wq_b and the indexer's wq_b), kv [S, D] unnormed)."""
        xq = self.numerics.quantize(x)  # read by wq_a and wkv: quantised once in native
        qa, kv = self.wq_a_kv(xq)
        return self.numerics.norm_quantized(qa, self.q_norm, self.args.norm_eps), kv

    def _queries(self, c, kv: torch.Tensor, rot,
                 kv_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
        """(q [S, H, D] normed + roped, kv normed + roped, storage-rounded) of `_query_lora`'s
        outputs; with `kv_out` = (buffer, rows), kv goes to buffer[rows] instead and None takes
        its place."""
        eps, s = self.args.norm_eps, kv.shape[0]
        q = self.wq_b(c).view(s, self.n_heads, self.head_dim)  # [S, H, D]
        q = self.rope.normed(q, None, eps, rot)
        kv = self.rope.normed(kv, self.kv_norm, eps, rot, round_lead=self.args.nope_head_dim, out=kv_out)  # [S, D]
        return q, kv

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output o [S, H, D] (numerics dtype, rotated back) -> wo_a -> wo_b -> [S, D]."""
        return self.wo_b(self.wo_a(o.reshape(o.shape[0], -1)))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, rot) -> torch.Tensor:
        """Sparse attention of q over rows idx of kv, then the inverse RoPE at `rot` (a table) -> [S, H, D]."""
        return self.numerics.sparse_attention(q, kv, idx, self.sink, self.head_dim ** -0.5, rot, self.rope.inv_freq)

    def _update_ring(self, kv: torch.Tensor, at: PrefillPosition, st: LayerState) -> None:
        """The ring keeps the newest W positions: the call's last min(S, W) keys kv [S, D] go to
        their slots p mod W."""
        s = kv.shape[0]
        keep = min(s, self.window)
        new, done = kv[s - keep:], 0
        for rows in _ring_rows(st.window, at.start + s - keep, keep):
            rows.copy_(new[done:done + rows.shape[0]])
            done += rows.shape[0]

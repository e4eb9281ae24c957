"""Attention of one DeepSeek-V4 layer (spec §C.4–§C.6): sliding window + compressed branch.

Every call processes S consecutive tokens of one sequence at absolute positions
start..start+S-1 (prefill, a prefill chunk, or one decode token) against the per-sequence
`LayerState`; the result is the same whatever the chunking.
"""

from __future__ import annotations

import torch

from engine.config import ModelArgs
from engine.linear import FloatLinear, FP8Linear, GroupedOutProj
from engine.numerics import Numerics
from engine.state import CompressorState, LayerState
from kernels import reference as ref


class Rope:
    """A layer's RoPE table: θ=rope_theta for ratio-0 layers, compress_rope_theta + YaRN else."""

    def __init__(self, args: ModelArgs, compressed: bool, device: torch.device):
        yarn = None
        if compressed:
            yarn = {"factor": args.rope_factor, "original_seq_len": args.original_seq_len,
                    "beta_fast": args.beta_fast, "beta_slow": args.beta_slow}
        theta = args.compress_rope_theta if compressed else args.rope_theta
        self.inv_freq = ref.rope_inv_freq(args.rope_head_dim, theta, yarn).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        cos, sin = ref.rope_cos_sin(positions, self.inv_freq)
        return ref.apply_rope(x, cos, sin, inverse)


def kv_rounding(kv: torch.Tensor, nope: int) -> torch.Tensor:
    """Native KV storage: QDQ8 (block 64) of the leading `nope` dims; the RoPE tail stays."""
    return torch.cat((ref.qdq8(kv[:, :nope], 64), kv[:, nope:]), dim=-1)


def fp4_rounding(x: torch.Tensor) -> torch.Tensor:
    """Native indexer q/k: Hadamard rotation, then QDQ4 (block 32)."""
    return ref.qdq4(ref.hadamard(x), 32)


class Compressor:
    """Gated pooling of every r tokens into one entry (§C.5); overlap scheme when r = 4.

    `kind` "attention" (d = head_dim; QDQ8 of the nope dims in native) or "indexer"
    (d = index_head_dim; Hadamard + QDQ4 in native).
    """

    def __init__(self, get, prefix: str, args: ModelArgs, ratio: int, dim: int, kind: str,
                 rope: Rope, numerics: Numerics):
        self.ratio, self.dim, self.kind, self.rope, self.numerics = ratio, dim, kind, rope, numerics
        self.overlap = ratio == 4
        self.wkv = FloatLinear(get(f"{prefix}.wkv.weight"), numerics)
        self.wgate = FloatLinear(get(f"{prefix}.wgate.weight"), numerics)
        self.ape = get(f"{prefix}.ape").float()  # [r, c·d]
        self.norm = get(f"{prefix}.norm.weight").float()
        self.eps = args.norm_eps
        self.rope_dim = args.rope_head_dim

    def __call__(self, x: torch.Tensor, start: int, st: CompressorState) -> None:
        """Project x [S, D] at positions start.., emit every completed window into st.entries."""
        r, d, s = self.ratio, self.dim, x.shape[0]
        positions = torch.arange(start, start + s, device=x.device)
        kv = self.wkv(x)  # [S, c·d] fp32
        gate = self.wgate(x) + self.ape[positions % r]
        n_buf = start % r  # tokens of the open window seen before this call
        kv = torch.cat((st.buf_kv[:n_buf], kv))
        gate = torch.cat((st.buf_gate[:n_buf], gate))
        n_win = kv.shape[0] // r
        rest = kv.shape[0] - n_win * r
        st.buf_kv[:rest] = kv[n_win * r:]
        st.buf_gate[:rest] = gate[n_win * r:]
        if n_win == 0:
            return
        first = (start - n_buf) // r  # index of the first window completed now
        win_kv = kv[: n_win * r].view(n_win, r, -1)  # [n_win, r, c·d]
        win_gate = gate[: n_win * r].view(n_win, r, -1)
        if self.overlap:
            win_kv, win_gate = self._overlap(win_kv, win_gate, st)  # [n_win, 2r, d]
        weights = torch.softmax(win_gate, dim=1)  # over the window's slots, per channel
        pooled = (win_kv * weights).sum(dim=1)  # [n_win, d] fp32
        entries = ref.rms_norm(pooled.to(self.numerics.dtype), self.norm, self.eps)
        entries = self.rope(entries, (first + torch.arange(n_win, device=x.device)) * r)
        st.store_entries(first, self._storage_rounding(entries))

    def _overlap(self, win_kv, win_gate, st: CompressorState):
        """8 slots per entry: the previous window's first half, then this window's second half."""
        r, d = self.ratio, self.dim
        prev_kv = torch.cat((self._prev(st.prev_kv, 0.0, win_kv), win_kv[:-1, :, :d]))  # [n_win, r, d]
        prev_gate = torch.cat((self._prev(st.prev_gate, float("-inf"), win_kv), win_gate[:-1, :, :d]))
        st.prev_kv, st.prev_gate = win_kv[-1, :, :d].clone(), win_gate[-1, :, :d].clone()
        kv = torch.cat((prev_kv, win_kv[:, :, d:]), dim=1)  # [n_win, 2r, d]
        gate = torch.cat((prev_gate, win_gate[:, :, d:]), dim=1)
        return kv, gate

    def _prev(self, saved: torch.Tensor | None, fill: float, like: torch.Tensor) -> torch.Tensor:
        if saved is None:  # window 0 has no predecessor: zero values with -inf logits
            return like.new_full((1, self.ratio, self.dim), fill)
        return saved.unsqueeze(0)

    def _storage_rounding(self, entries: torch.Tensor) -> torch.Tensor:
        if not self.numerics.native:
            return entries
        if self.kind == "indexer":
            return fp4_rounding(entries)
        return kv_rounding(entries, self.dim - self.rope_dim)


class Indexer:
    """Lightning indexer of CSA layers (§C.6): scores visible entries, keeps the top-k."""

    def __init__(self, get, prefix: str, args: ModelArgs, rope: Rope, numerics: Numerics):
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.ratio, self.rope, self.numerics = 4, rope, numerics
        self.wq_b = FP8Linear(get(f"{prefix}.wq_b.weight"), get(f"{prefix}.wq_b.scale"), numerics)
        self.weights_proj = FloatLinear(get(f"{prefix}.weights_proj.weight"), numerics, bf16_out=True)
        self.compressor = Compressor(get, f"{prefix}.compressor", args, 4, args.index_head_dim, "indexer",
                                     rope, numerics)

    def __call__(self, x: torch.Tensor, c: torch.Tensor, start: int, st: CompressorState, log=None) -> torch.Tensor:
        """Selected attention-compressor entries per query: [S, index_topk] int64, -1 = none.

        `log(scores)` sees the masked index scores [S, n_entries] (tests explain tie flips)."""
        s = x.shape[0]
        positions = torch.arange(start, start + s, device=x.device)
        self.compressor(x, start, st)
        n_entries = (start + s) // self.ratio
        q = self.wq_b(c).view(s, self.n_heads, self.head_dim)  # [S, IH, ID]
        q = self.rope(q, positions)
        if self.numerics.native:
            q = fp4_rounding(q)
        keys = st.entries[:n_entries]
        dots = torch.relu(torch.einsum("shd,td->sht", q.float(), keys.float())) * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.n_heads ** -0.5  # [S, IH]
        scores = (dots * w.unsqueeze(-1)).sum(dim=1)  # [S, T]
        visible = (positions + 1) // self.ratio  # entries w < visible are complete at p
        invisible = torch.arange(n_entries, device=x.device).unsqueeze(0) >= visible.unsqueeze(1)
        scores = scores.masked_fill(invisible, float("-inf"))
        if log is not None:
            log(scores)
        k = min(self.topk, n_entries)
        top = ref.topk_desc(scores, k)
        top = torch.where(top >= visible.unsqueeze(1), torch.full_like(top, -1), top)
        if k < self.topk:  # fixed width: always `index_topk` candidates, absent ones -1
            top = torch.cat((top, top.new_full((s, self.topk - k), -1)), dim=1)
        return top


class Attention:
    """Query/KV projections, window + compressed keys, one softmax with sink, grouped output."""

    def __init__(self, get, prefix: str, args: ModelArgs, layer: int, numerics: Numerics):
        self.args, self.numerics = args, numerics
        self.ratio = args.ratio(layer)
        self.n_heads, self.head_dim, self.window = args.n_heads, args.head_dim, args.window_size
        self.sink = get(f"{prefix}.attn_sink").float()
        self.rope = Rope(args, self.ratio > 0, self.sink.device)  # tables live with the weights
        self.wq_a = FP8Linear(get(f"{prefix}.wq_a.weight"), get(f"{prefix}.wq_a.scale"), numerics)
        self.q_norm = get(f"{prefix}.q_norm.weight").float()
        self.wq_b = FP8Linear(get(f"{prefix}.wq_b.weight"), get(f"{prefix}.wq_b.scale"), numerics)
        self.wkv = FP8Linear(get(f"{prefix}.wkv.weight"), get(f"{prefix}.wkv.scale"), numerics)
        self.kv_norm = get(f"{prefix}.kv_norm.weight").float()
        self.wo_a = GroupedOutProj(get(f"{prefix}.wo_a.weight"), get(f"{prefix}.wo_a.scale"), args.o_groups,
                                   numerics)
        self.wo_b = FP8Linear(get(f"{prefix}.wo_b.weight"), get(f"{prefix}.wo_b.scale"), numerics)
        self.compressor = self.indexer = None
        if self.ratio:
            self.compressor = Compressor(get, f"{prefix}.compressor", args, self.ratio, args.head_dim,
                                         "attention", self.rope, numerics)
        if self.ratio == 4:
            self.indexer = Indexer(get, f"{prefix}.indexer", args, self.rope, numerics)

    def __call__(self, x: torch.Tensor, start: int, st: LayerState, log=None) -> torch.Tensor:
        """x [S, D] (attn-normed) at positions start.. -> [S, D].

        `log(kind, tensor)` sees the indexer's scores ("indexer_scores") and picks ("indexer")."""
        args, s, eps = self.args, x.shape[0], self.args.norm_eps
        positions = torch.arange(start, start + s, device=x.device)
        c = ref.rms_norm(self.wq_a(x), self.q_norm, eps)  # [S, q_lora_rank]
        q = self.wq_b(c).view(s, self.n_heads, self.head_dim)  # [S, H, D]
        q = ref.rms_norm(q, None, eps)
        q = self.rope(q, positions)
        kv = ref.rms_norm(self.wkv(x), self.kv_norm, eps)  # [S, D]
        kv = self.rope(kv, positions)
        if self.numerics.native:
            kv = kv_rounding(kv, args.nope_head_dim)

        window_kv, idx = self._window(kv, start, st)
        if self.ratio:
            self.compressor(x, start, st.compressor)
            n_entries = (start + s) // self.ratio
            if self.indexer is not None:
                chosen = self.indexer(x, c, start, st.indexer,
                                      None if log is None else lambda t: log("indexer_scores", t))
                if log is not None:
                    log("indexer", chosen)
            else:  # HCA: every complete entry, -1 for those not yet visible at p
                chosen = torch.arange(n_entries, device=x.device).expand(s, -1)
                visible = ((positions + 1) // self.ratio).unsqueeze(1)
                chosen = torch.where(chosen < visible, chosen, torch.full_like(chosen, -1))
            chosen = torch.where(chosen >= 0, chosen + window_kv.shape[0], chosen)
            window_kv = torch.cat((window_kv, st.compressor.entries[:n_entries]))
            idx = torch.cat((idx, chosen), dim=1)

        o = self._attend(q, window_kv, idx)  # [S, H, D] fp32
        o = self.rope(o.to(self.numerics.dtype), positions, inverse=True)
        z = self.wo_a(o.reshape(s, -1))
        return self.wo_b(z)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.numerics.native:
            return self.numerics.backend.sparse_attention(q, kv, idx, self.sink, self.head_dim ** -0.5)
        return ref.sparse_attention(q, kv, idx, self.sink, self.head_dim ** -0.5)

    def _window(self, kv: torch.Tensor, start: int, st: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys for the window branch and per-query indices into them, then update the ring.

        Returns kv_win [L, D] = ring tokens before `start` (up to W-1) followed by the S new
        ones, and idx [S, W] of positions p-W+1..p (-1 before position 0).
        """
        w, s, dev = self.window, kv.shape[0], kv.device
        n_prev = min(start, w - 1)
        prev_pos = torch.arange(start - n_prev, start, device=dev)
        kv_win = torch.cat((st.window[prev_pos % w], kv.to(st.window.dtype)))
        first = start - n_prev  # position of kv_win[0]
        want = (torch.arange(start, start + s, device=dev).unsqueeze(1)
                - torch.arange(w - 1, -1, -1, device=dev).unsqueeze(0))  # [S, W]
        idx = torch.where(want >= 0, want - first, torch.full_like(want, -1))
        keep = min(s, w)  # the ring keeps the newest W positions
        new_pos = torch.arange(start + s - keep, start + s, device=dev)
        st.window[new_pos % w] = kv[s - keep:].to(st.window.dtype)
        return kv_win, idx

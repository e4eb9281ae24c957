"""The two numerics modes of one model (DESIGN §3), as two strategies with one op vocabulary.

* `exact` (`Exact`): fp32 everywhere on dequantised weights, no quantisation simulation.
  Matches transformers' DeepseekV4ForCausalLM loaded in fp32.
* `native` (`Native`): the official serving numerics: bf16 residual streams and activations,
  FP8 activation quantisation before every FP8/FP4 linear, QDQ8 of the KV "nope" dims, Hadamard
  + QDQ4 in the indexer, wo_a in bf16 without activation quantisation (the official convert.py
  dequantises its FP8 weight to bf16, which is exact; the backend reads the FP8 bytes). Its
  quantised and fused ops run on the kernel backend (kernels/backend.py).

The model's modules call the ops below and never ask which mode runs. Weights are prepared for
the mode once, at load (`fp8_weight`, `fp8_groups`, `grouped_weight`, `float_weight`,
`compressor_weight`, `shared_expert_weights`): a module holds the prepared form, opaque to it,
and hands it back to the matching op. Each op is the exact sequence of operations the mode ran
before this split, so results are unchanged bit for bit.

Chunking (`EngineConfig.prefill_chunk`, engine.buckets.chunk_lengths): in both modes a token's
result does not depend on how its prompt is split into forward calls. Every op computes a row
on its own (native's FP8 activation quantisation is per row, in blocks of 128 along it; the
reference's `matmul` pads a product of fewer than 4 rows to keep its rows the same), so on the
torch reference (the CPU) a prefill in chunks of any size, token by token included, gives the
logits and selections of one prefill bit for bit (tests/engine/test_model_paths.py) — given the
CPU's matrix products pinned to MKL's reproducible path (engine/reproducible.py: the entry
points and the tests set MKL_CBWR before the first product; a program that drives the engine
itself must do the same). Without that pin MKL may round a product differently in its last bits
for another chunking, which exact shows as such (~1e-6 relative on the tiny model) and native's
FP8 quantisation can turn into a flipped quantisation step and a few per cent on the logits
(up to 14 % relative max on the tiny model, prefill_chunk 1 or 7 against one chunk): not a
bound of native, a CPU setup error. The bitwise promise is the reference's: the graph runner's
one-token and chunk steps (engine/decode_graph.py, the GPU's short-prefill and decode path)
agree with the forward within 1e-4 relative (tests/engine/test_decode_graph.py, run eagerly on
the CPU: a reduction over another number of masked slots may round differently), and the
TileLang kernels take another kernel for at most 16 rows than for more (kernels/fp8_gemm.py),
so on CUDA no bitwise chunking promise is made (nor tested).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.experts.weights import ExpertWeights
from kernels import reference as ref
from kernels.backend import Backend, torch_backend


@dataclass(frozen=True)
class Quantized:
    """An activation x [M, K] with its FP8 quantisation (act_quant, blocks of 128: q e4m3, s fp32),
    computed once for the several FP8 linears that read it (native numerics)."""

    x: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor


def unquantized(x: "torch.Tensor | Quantized") -> torch.Tensor:
    """The activation itself, whether or not it carries its quantisation."""
    return x.x if isinstance(x, Quantized) else x


@dataclass(frozen=True)
class FP8Weight:
    """An FP8 e4m3 weight [N, K] with its 128×128 e8m0 block scales, kept as on disk (native),
    and those scales' fp32 values (what the backend's block-scaled prefill GEMM reads; converted
    once here instead of three launches per call)."""

    weight: torch.Tensor
    scale: torch.Tensor
    scale_f32: torch.Tensor

    @staticmethod
    def of(weight: torch.Tensor, scale: torch.Tensor) -> "FP8Weight":
        return FP8Weight(weight, scale, ref.e8m0_to_float(scale))


class Numerics(ABC):
    """One numerics mode: its activation dtype, its weight preparation and its ops.

    `backend` executes native's quantised and fused ops (exact runs kernels/reference.py's fp32
    math and needs none). `name` identifies the mode for reports; there is no flag to branch on:
    what differs between the modes is an op or a capability below. Ops whose signature and math
    are the reference's in both modes (norms, mHC, routing, the combine, sparse index, indexer
    scores, head) run on `ops`: the backend in native, the reference in exact."""

    name: str
    dtype: torch.dtype  # storage dtype of activations, residual streams and KV
    batched_experts: bool  # all (token, choice) cells of a call on a full arena in one op (MoE._arena_cells)
    decode_graphs: bool  # the one-token decode step may be captured in CUDA graphs (engine/decode_graph.py)

    def __init__(self, backend: Backend, ops: Backend):
        self.backend, self.ops = backend, ops

    @staticmethod
    def named(name: str, backend: Backend | None = None) -> "Numerics":
        """The mode called `name` ("exact" or "native") on `backend` (default: the torch reference)."""
        if name not in ("exact", "native"):
            raise ValueError(f"numerics must be 'exact' or 'native', got {name!r}")
        backend = backend or torch_backend()
        return Native(backend) if name == "native" else Exact(backend)

    @property
    def reference_ops(self) -> tuple[str, ...]:
        """The backend ops this mode runs on the pure-torch reference (exact: all of them)."""
        return self.ops.reference_ops

    # -------------------------------------------------------- ops shared by both modes
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm (§C.0): native runs the backend's (one fused launch on CUDA), exact the reference."""
        return self.ops.rms_norm(x, weight, eps)

    def hc_pre(self, streams, fn, scale, base, n, hc_eps, eps):
        return self.ops.hc_pre(streams, fn, scale, base, n, hc_eps, eps)

    def hc_post(self, out, streams, post, comb_logits, iters, hc_eps, early=False):
        return self.ops.hc_post(out, streams, post, comb_logits, iters, hc_eps, early)

    def hc_post_pre(self, out, streams, post, comb_logits, iters, hc_eps, fn, scale, base, eps, early=False):
        return self.ops.hc_post_pre(out, streams, post, comb_logits, iters, hc_eps, fn, scale, base, eps, early)

    def moe_post_pre(self, routed, shared, rows, streams, post, comb_logits, iters, hc_eps, fn, scale, base, eps,
                     early=False):
        """`moe_combine` of a MoE layer's parts (into the streams' dtype, which is `dtype`), then
        `hc_post_pre`, as one op (on CUDA the combine's launch goes)."""
        return self.ops.moe_post_pre(routed, shared, rows, streams, post, comb_logits, iters, hc_eps, fn, scale,
                                     base, eps, early)

    def compressor_pool(self, win_kv: torch.Tensor, win_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                        prev_gate: torch.Tensor | None) -> torch.Tensor:
        """Consecutive completed windows [n, r, C] -> their pooled entries [n, d] in this mode's
        dtype (`reference.compressor_pool`: an overlap compressor's prev takes the last window's
        first halves in place); native: one launch on CUDA instead of about ten."""
        return self.ops.compressor_pool(win_kv, win_gate, prev_kv, prev_gate, self.dtype)

    def moe_gate(self, x, weight, bias, k, route_scale, hash_ids):
        return self.ops.moe_gate(x, weight, bias, k, route_scale, hash_ids)

    def moe_combine(self, routed: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """routed [N, k, D] summed over k in order, plus shared [N, D], rounded once into `dtype`;
        with `rows` [N, k], routed is cells [G, D] and (n, j) is row rows[n, j]."""
        return self.ops.moe_combine(routed, shared, self.dtype, rows)

    def sparse_index(self, window_rows, order, visible, k, offset, width):
        return self.ops.sparse_index(window_rows, order, visible, k, offset, width)

    def index_picks(self, scores, window_rows, visible, k, offset, width):
        return self.ops.index_picks(scores, window_rows, visible, k, offset, width)

    def indexer_scores(self, q, keys, weights, visible, scale):
        return self.ops.indexer_scores(q, keys, weights, visible, scale)

    def head_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.ops.head_logits(x, w)

    # -------------------------------------------------------- ops each mode implements
    @abstractmethod
    def quantize(self, x: "torch.Tensor | Quantized") -> "Quantized | torch.Tensor":
        """x [M, K] for several FP8 linears: native quantises it once (an already `Quantized` x
        passes), exact passes it on (no activation quantisation)."""

    @abstractmethod
    def norm_quantized(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> "Quantized | torch.Tensor":
        """RMSNorm of x [M, K] for FP8 linears (and other readers of `.x`): native normalises and
        quantises in one backend op, exact normalises."""

    @abstractmethod
    def fp8_weight(self, weight: torch.Tensor, scale: torch.Tensor):
        """An FP8 block-scaled weight [N, K] prepared for `fp8_linear`."""

    def fp8_groups(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[object, list[int]]]:
        """FP8 weights (weight, scale) that read the same input, as [(prepared weight, rows of each
        part in it)]: one group per part (native stacks them, `Native.fp8_groups`)."""
        return [(self.fp8_weight(w, s), [w.shape[0]]) for w, s in parts]

    @abstractmethod
    def fp8_linear(self, w, x: "torch.Tensor | Quantized") -> torch.Tensor:
        """x [..., K] (or a `quantize`d [M, K]) times a prepared FP8 weight -> [..., N]
        (native: bf16, the official FP8 GEMM; exact: fp32)."""

    @abstractmethod
    def grouped_weight(self, weight: torch.Tensor, scale: torch.Tensor, groups: int):
        """wo_a's FP8 weight [G·R, K] prepared for `grouped_linear`."""

    @abstractmethod
    def grouped_linear(self, w, o: torch.Tensor, groups: int) -> torch.Tensor:
        """wo_a (§C.4 steps 14–15): o [S, G·K] group g × its own rows -> [S, G·R]."""

    @abstractmethod
    def float_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A BF16 weight read in fp32 products (the indexer's weights_proj)."""

    @abstractmethod
    def indexer_weights(self, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        """The indexer's head weights [S, IH] fp32 of x [S, D] with a `float_weight`."""

    @abstractmethod
    def compressor_weight(self, wkv: torch.Tensor, wgate: torch.Tensor):
        """A compressor's BF16 wkv and wgate [c·d, D] prepared for `compressor_project`."""

    @abstractmethod
    def compressor_project(self, w, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, D] -> (kv, gate logits without ape) [S, c·d], fp32 products of the bf16 weights."""

    @abstractmethod
    def compressor_project_rows(self, w, x: torch.Tensor, ape: torch.Tensor, row: torch.Tensor,
                                buf_kv: torch.Tensor, buf_gate: torch.Tensor) -> None:
        """One token x [1, D] projected into rows `row` of buf_kv and (+ ape[row]) buf_gate, in place."""

    @abstractmethod
    def round_index(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's storage rounding of queries and keys: native Hadamard + QDQ4 per 32,
        exact none."""

    @abstractmethod
    def rope_table(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        """What rotating several tensors at `positions` [S] needs once: native the positions
        themselves, exact the (cos, sin) tables [S, rope_dim/2]."""

    @abstractmethod
    def rope(self, x: torch.Tensor, at, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x at `at`: positions [S], or a `rope_table` of them."""

    @abstractmethod
    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, at, inv_freq: torch.Tensor,
                  round_lead: int = 0, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """RMSNorm of x (weight or None), then rotated at `at`; native also QDQ8-rounds the leading
        `round_lead` channels (KV storage; exact has no storage rounding). `out` = (buffer, rows):
        token s is written to buffer[rows[s]] instead (None returned)."""

    @abstractmethod
    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float, rot, inv_freq: torch.Tensor) -> torch.Tensor:
        """Sparse attention of q over rows idx of kv, then the inverse RoPE at `rot` -> [S, H, D]."""

    @abstractmethod
    def routed_expert(self, x: torch.Tensor, e: ExpertWeights, weight: torch.Tensor, limit: float) -> torch.Tensor:
        """One routed expert on its tokens x [T, D] with routing weights [T] (scaling h before
        w2, §C.7 step 4) -> fp32 [T, D]."""

    @abstractmethod
    def arena_experts(self, x: "torch.Tensor | Quantized", arena, layer: int, idx: torch.Tensor,
                      w: torch.Tensor, limit: float, early: bool = False) -> torch.Tensor:
        """One token's k routed experts (ids idx [1, k], weights w [1, k]) read from `arena`'s
        slots of `layer` -> fp32 [k, D] (row j = choice j), no host sync. `early`: the kernel
        queued just before this call writes neither the ids nor the arena and its table, so the
        experts' kernels may read them before it completes (kernels/pdl.py)."""

    @abstractmethod
    def shared_expert_weights(self, w1: tuple[torch.Tensor, torch.Tensor], w3: tuple[torch.Tensor, torch.Tensor],
                              w2: tuple[torch.Tensor, torch.Tensor]):
        """The shared expert's FP8 (weight, scale) w1, w3, w2 prepared for `shared_expert`."""

    @abstractmethod
    def shared_expert(self, w, x: "torch.Tensor | Quantized", limit: float) -> torch.Tensor:
        """The shared expert on x [N, D] (native: bf16, may reuse x's quantisation; exact: fp32)."""


class Exact(Numerics):
    """fp32 reference math on dequantised weights (kernels/reference.py)."""

    name, dtype = "exact", torch.float32
    batched_experts = False  # no fp32 one-launch routed-experts op
    decode_graphs = False  # the fp32 reference decodes eagerly

    def __init__(self, backend: Backend | None = None):
        super().__init__(backend or torch_backend(), torch_backend())

    def quantize(self, x):
        return x

    def norm_quantized(self, x, weight, eps):
        return ref.rms_norm(x, weight, eps)

    def fp8_weight(self, weight, scale):
        return ref.dequant_fp8_block(weight, scale)  # fp32 [N, K]

    def fp8_linear(self, w, x):
        return ref.matmul(x.float(), w.T)

    def grouped_weight(self, weight, scale, groups):
        w = ref.dequant_fp8_block(weight, scale)  # fp32 [G*R, H*D/G]
        return w.view(groups, -1, w.shape[-1])  # [G, R, H*D/G]

    def grouped_linear(self, w, o, groups):
        s = o.shape[0]
        u = o.to(w.dtype).view(s, groups, -1)  # [S, G, H*D/G]
        return ref.grouped_matmul(u, w).reshape(s, -1)

    def float_weight(self, w):
        return w.float()

    def indexer_weights(self, x, w, scale):
        return ref.matmul(x.float(), w.T).float() * scale

    def compressor_weight(self, wkv, wgate):
        return wkv.float(), wgate.float()

    def compressor_project(self, w, x):
        xf = x.float()
        return ref.matmul(xf, w[0].T), ref.matmul(xf, w[1].T)  # fp32 products of the widened weights

    def compressor_project_rows(self, w, x, ape, row, buf_kv, buf_gate):
        kv, gate = self.compressor_project(w, x)
        buf_kv.index_copy_(0, row, kv)
        buf_gate.index_copy_(0, row, gate + ape[row])

    def round_index(self, x):
        return x

    def rope_table(self, positions, inv_freq):
        return ref.rope_cos_sin(positions, inv_freq)

    def rope(self, x, at, inv_freq, inverse=False):
        cos, sin = self.rope_table(at, inv_freq) if isinstance(at, torch.Tensor) else at
        return ref.apply_rope(x, cos, sin, inverse)

    def norm_rope(self, x, weight, eps, at, inv_freq, round_lead=0, out=None):
        y = self.rope(ref.rms_norm(x, weight, eps), at, inv_freq)
        if out is None:
            return y
        out[0].index_copy_(0, out[1], y.to(out[0].dtype))
        return None

    def sparse_attention(self, q, kv, idx, sink, scale, rot, inv_freq):
        return self.rope(ref.sparse_attention(q, kv, idx, sink, scale), rot, inv_freq, inverse=True)

    def routed_expert(self, x, e, weight, limit):
        w1 = ref.dequant_fp4(e.w1, e.w1_scale)
        w3 = ref.dequant_fp4(e.w3, e.w3_scale)
        w2 = ref.dequant_fp4(e.w2, e.w2_scale)
        xf = x.float()
        h = ref.swiglu(ref.matmul(xf, w1.T), ref.matmul(xf, w3.T), limit) * weight.unsqueeze(1)
        return ref.matmul(h, w2.T)

    def arena_experts(self, x, arena, layer, idx, w, limit, early=False):
        x = unquantized(x)
        slots = arena.table[layer].index_select(0, idx[0]).clamp_min(0)  # [k] int32
        recs = arena.data.index_select(0, slots.long())  # [k, R]
        return torch.cat([self.routed_expert(x, ExpertWeights.from_fields(arena.record.unpack(recs[j])), w[:, j], limit)
                          for j in range(idx.shape[1])])

    def shared_expert_weights(self, w1, w3, w2):
        return self.fp8_weight(*w1), self.fp8_weight(*w3), self.fp8_weight(*w2)

    def shared_expert(self, w, x, limit):
        w1, w3, w2 = w
        h = ref.swiglu(self.fp8_linear(w1, x), self.fp8_linear(w3, x), limit)
        return self.fp8_linear(w2, h)


class Native(Numerics):
    """The official serving numerics, its quantised and fused ops on `backend`."""

    name, dtype = "native", torch.bfloat16
    batched_experts = True  # the backend's fp4_moe over arena slots
    decode_graphs = True

    def __init__(self, backend: Backend | None = None):
        backend = backend or torch_backend()
        super().__init__(backend, backend)

    def quantize(self, x):
        if isinstance(x, Quantized):
            return x
        return Quantized(x, *self.backend.act_quant(x, 128))

    def norm_quantized(self, x, weight, eps):
        return Quantized(*self.backend.rms_norm_quant(x, weight, eps))

    def fp8_weight(self, weight, scale):
        return FP8Weight.of(weight, scale)  # kept in the on-disk format for the backend's FP8 GEMM

    def fp8_groups(self, parts):
        """One stacked weight [Σ N, K] (one GEMM/GEMV for all readers) when the block scales stack:
        every part but the last fills whole 128-row blocks; else one per part."""
        if len(parts) > 1 and all(w.shape[0] % 128 == 0 for w, _ in parts[:-1]):
            return [(FP8Weight.of(torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])),
                     [w.shape[0] for w, _ in parts])]
        return super().fp8_groups(parts)

    def fp8_linear(self, w, x):
        if isinstance(x, Quantized):
            return self.backend.fp8_gemm_quantized(x.q, x.s, w.weight, w.scale, w.scale_f32)
        return self.backend.fp8_gemm(x, w.weight, w.scale, w.scale_f32)

    def grouped_weight(self, weight, scale, groups):
        return FP8Weight.of(weight, scale)  # the backend keeps the FP8 bytes (half the bf16 copy's)

    def grouped_linear(self, w, o, groups):
        return self.backend.grouped_linear(o.to(torch.bfloat16), w.weight, w.scale, groups, w.scale_f32)

    def float_weight(self, w):
        return w  # bf16 as on disk: the backend's op widens it

    def indexer_weights(self, x, w, scale):
        return self.backend.indexer_weights(x, w, scale)

    def compressor_weight(self, wkv, wgate):
        return torch.cat((wkv, wgate))  # [2·c·d, D] bf16: the backend projects both at once

    def compressor_project(self, w, x):
        y = self.backend.bf16_gemm(x, w)  # [S, 2·c·d] fp32: both projections in one GEMM
        c = w.shape[0] // 2
        return y[:, :c], y[:, c:]

    def compressor_project_rows(self, w, x, ape, row, buf_kv, buf_gate):
        self.backend.compressor_project(x, w, ape, row, buf_kv, buf_gate)  # one launch on CUDA

    def round_index(self, x):
        return self.backend.hadamard_qdq4(x, 32)

    def rope_table(self, positions, inv_freq):
        return positions  # the backend computes the angles in the kernel

    def rope(self, x, at, inv_freq, inverse=False):
        return self.backend.rope(x, at, inv_freq, inverse)

    def norm_rope(self, x, weight, eps, at, inv_freq, round_lead=0, out=None):
        return self.backend.norm_rope(x, weight, eps, at, inv_freq, round_lead, *(out or ()))

    def sparse_attention(self, q, kv, idx, sink, scale, rot, inv_freq):
        # one backend op: the rotation back is the attention's last step
        return self.backend.sparse_attention(q, kv, idx, sink, scale, (rot, inv_freq))

    def routed_expert(self, x, e, weight, limit):
        return ref.routed_expert(x, e.w1, e.w1_scale, e.w3, e.w3_scale, e.w2, e.w2_scale, weight, limit,
                                 self.backend.fp4_gemm)

    def arena_experts(self, x, arena, layer, idx, w, limit, early=False):
        xq = self.quantize(x)  # one row for all k choices
        # the kernels look the experts' slots up in the layer's table
        return self.backend.fp4_moe_quantized(xq.q, xq.s, arena.data, arena.record.fields, idx[0], w[0], limit,
                                              arena.table[layer], early=early)

    def shared_expert_weights(self, w1, w3, w2):
        # w1 and w3 read the same activations: one GEMM over both (inter % 128 == 0)
        return FP8Weight.of(torch.cat((w1[0], w3[0])), torch.cat((w1[1], w3[1]))), FP8Weight.of(*w2)

    def shared_expert(self, w, x, limit):
        """w1|w3 in one FP8 GEMM (on x's quantisation when it carries one), SwiGLU fused with w2's
        activation quantisation."""
        w13, w2 = w
        gu = self.fp8_linear(w13, x)  # [N, 2·inter] bf16
        inter = gu.shape[-1] // 2
        q, s = self.backend.swiglu_quant(gu[:, :inter], gu[:, inter:], None, limit)
        return self.backend.fp8_gemm_quantized(q, s, w2.weight, w2.scale, w2.scale_f32)

"""Kernel backends: who executes the quantised GEMMs and the sparse attention in `native` numerics.

`TorchBackend` runs kernels/reference.py (CPU, and any device torch supports); `TileLangBackend`
runs the TileLang kernels of this package on CUDA, imported lazily on first use so that CPU-only
machines never import TileLang. Both expose the reference signatures, so an engine built on one
can be checked against the other.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Protocol

import torch

from kernels import reference as ref
from kernels.toolkit import KernelFactory


class Backend(Protocol):
    name: str

    def fp8_gemm(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        """FP8-quantised activations [M, K] × FP8 block-scaled weight [N, K] -> bf16 [M, N]."""
        ...

    def act_quant(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 activation quantisation: x [..., K] -> (q e4m3, s [..., K/block] fp32)."""
        ...

    def fp8_gemm_quantized(self, q: torch.Tensor, s: torch.Tensor, w: torch.Tensor,
                           w_scale: torch.Tensor) -> torch.Tensor:
        """`fp8_gemm` on activations already quantised by act_quant (q [M, K] e4m3, s [M, K/128])."""
        ...

    def fp4_gemm(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        """FP8-quantised activations [M, K] × FP4 weight [N, K/2] (1×32 scales) -> bf16 [M, N]."""
        ...

    def compressor_project(self, x: torch.Tensor, w: torch.Tensor, ape: torch.Tensor, row: torch.Tensor,
                           buf_kv: torch.Tensor, buf_gate: torch.Tensor) -> None:
        """x [M, D] × bf16 [wkv; wgate] in fp32 -> rows `row` of buf_kv and (+ ape[row]) buf_gate, in place."""
        ...

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int) -> torch.Tensor:
        """bf16 x [S, G·K], group g × rows g·R.. of an FP8 block-scaled weight [G·R, K] -> bf16 [S, G·R]."""
        ...

    def moe_gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, route_scale: float,
                 hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router: (expert ids [N, k], routing weights [N, k] fp32) of x [N, D]."""
        ...

    def swiglu_quant(self, g: torch.Tensor, u: torch.Tensor, weights: torch.Tensor | None,
                     limit: float) -> tuple[torch.Tensor, torch.Tensor]:
        """act_quant((swiglu(g, u, limit) · weights) in bf16): an expert's w2 input, quantised."""
        ...

    def moe_combine(self, routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """routed [N, k, D] summed over k in order, plus shared [N, D], rounded once into dtype."""
        ...

    def indexer_weights(self, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        """The indexer's head weights: float(bf16(x · w^T)) · scale, fp32 [S, IH]."""
        ...

    def sparse_index(self, window_rows: torch.Tensor, order: torch.Tensor, visible: torch.Tensor, k: int,
                     offset: int, width: int) -> torch.Tensor:
        """A decode query's key rows [S, W + width]: window rows, then order[:, :k] + offset where
        below visible (-1 elsewhere), -1 up to width."""
        ...

    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """q [S, H, D], kv [T, D], idx [S, K] (-1 absent), sink [H] -> [S, H, D] in q's dtype;
        `inverse_rope` = (positions [S], inv_freq): rotated back by the queries' RoPE angles."""
        ...

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """Lightning-indexer scores [S, T] fp32 of q [S, H, D] over keys [T, D], -inf where not visible."""
        ...

    def fp4_moe(self, x: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor,
                weights: torch.Tensor, limit: float) -> torch.Tensor:
        """Routed experts read from arena slots (one per row of x) -> fp32 [G, D]."""
        ...

    def fp4_moe_quantized(self, q: torch.Tensor, s: torch.Tensor, arena: torch.Tensor, fields: dict,
                          slots: torch.Tensor, weights: torch.Tensor, limit: float,
                          table: torch.Tensor | None = None, early: bool = False) -> torch.Tensor:
        """`fp4_moe` on act_quant's (q, s) [A, D] (A = G, or 1 for every slot) -> fp32 [G, D];
        with `table`, slots are expert ids looked up in it. `early`: the launch just before this
        call writes neither slots, table nor arena (the kernels may then read them sooner)."""
        ...

    def head_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, D] × bf16 head weight [V, D] in fp32 -> logits [M, V] fp32."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm of x's last dim in fp32 (weight [D] or None), cast back to x's dtype."""
        ...

    def rms_norm_quant(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RMSNorm of x [M, K] and its act_quant: (y, q e4m3, s [M, K/128])."""
        ...

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool) -> torch.Tensor:
        """Interleaved RoPE of x [S, ..., D]'s trailing 2·len(inv_freq) channels at positions [S]."""
        ...

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, round_lead: int, out: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """RMSNorm, RoPE at positions, QDQ8 of the leading `round_lead` channels (0: none); with
        `out` and `rows`, token s goes to out[rows[s]] in place (None returned)."""
        ...

    def hadamard_qdq4(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """Hadamard rotation of x's last dim (a power of two), then QDQ4 per `block`; keeps the dtype."""
        ...

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
               iters: int, hc_eps: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC HCPre: streams [S, n, D] -> (x [S, D], post [S, n], comb [S, n, n])."""
        ...

    def hc_post(self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """mHC HCPost: out [S, D] and streams [S, n, D] -> new streams [S, n, D]."""
        ...


class TorchBackend:
    """The pure-torch reference path."""

    name = "torch"

    def fp8_gemm(self, x, w, w_scale):
        return ref.fp8_gemm(x, w, w_scale)

    def act_quant(self, x, block):
        return ref.act_quant(x, block)

    def fp8_gemm_quantized(self, q, s, w, w_scale):
        return ref.fp8_gemm_quantized(q, s, w, w_scale)

    def fp4_gemm(self, x, w, w_scale):
        return ref.fp4_gemm(x, w, w_scale)

    def compressor_project(self, x, w, ape, row, buf_kv, buf_gate):
        ref.compressor_project(x, w, ape, row, buf_kv, buf_gate)

    def grouped_linear(self, x, w, w_scale, groups):
        return ref.grouped_linear(x, w, w_scale, groups)

    def moe_gate(self, x, weight, bias, k, route_scale, hash_ids):
        return ref.moe_gate(x, weight, bias, k, route_scale, hash_ids)

    def swiglu_quant(self, g, u, weights, limit):
        return ref.swiglu_quant(g, u, weights, limit)

    def moe_combine(self, routed, shared, dtype):
        return ref.moe_combine(routed, shared, dtype)

    def indexer_weights(self, x, w, scale):
        return ref.indexer_weights(x, w, scale)

    def sparse_index(self, window_rows, order, visible, k, offset, width):
        return ref.sparse_index(window_rows, order, visible, k, offset, width)

    def sparse_attention(self, q, kv, idx, sink, scale, inverse_rope=None):
        return ref.sparse_attention(q, kv, idx, sink, scale, inverse_rope)

    def indexer_scores(self, q, keys, weights, visible, scale):
        return ref.indexer_scores(q, keys, weights, visible, scale)

    def fp4_moe(self, x, arena, fields, slots, weights, limit):
        return ref.fp4_moe(x, arena, fields, slots, weights, limit)

    def fp4_moe_quantized(self, q, s, arena, fields, slots, weights, limit, table=None, early=False):
        return ref.fp4_moe_quantized(q, s, arena, fields, slots, weights, limit, table, early)

    def head_logits(self, x, w):
        return ref.head_logits(x, w)

    def rms_norm(self, x, weight, eps):
        return ref.rms_norm(x, weight, eps)

    def rms_norm_quant(self, x, weight, eps):
        return ref.rms_norm_quant(x, weight, eps)

    def rope(self, x, positions, inv_freq, inverse):
        return ref.rope(x, positions, inv_freq, inverse)

    def norm_rope(self, x, weight, eps, positions, inv_freq, round_lead, out=None, rows=None):
        return ref.norm_rope(x, weight, eps, positions, inv_freq, round_lead, out, rows)

    def hadamard_qdq4(self, x, block):
        return ref.hadamard_qdq4(x, block)

    def hc_pre(self, streams, fn, scale, base, n, iters, hc_eps, eps):
        return ref.hc_pre(streams, fn, scale, base, n, iters, hc_eps, eps)

    def hc_post(self, out, streams, post, comb):
        return ref.hc_post(out, streams, post, comb)


class TileLangBackend:
    """TileLang kernels (CUDA only). Each op falls back to the reference where no kernel exists
    yet, and says so in `missing` so benchmarks can report it."""

    name = "tilelang"
    _OPS = {"fp8_gemm": "kernels.fp8_gemm", "fp4_gemm": "kernels.fp4_moe", "fp4_moe": "kernels.fp4_moe",
            "fp4_moe_quantized": "kernels.fp4_moe", "sparse_attention": "kernels.sparse_attention",
            "head_logits": "kernels.head_gemv", "rms_norm": "kernels.rms_norm",
            "rope": "kernels.rope", "hadamard_qdq4": "kernels.hadamard_qdq4",
            "hc_pre": "kernels.mhc", "hc_post": "kernels.mhc", "fp8_gemm_quantized": "kernels.fp8_gemm",
            "swiglu_quant": "kernels.swiglu_quant", "moe_combine": "kernels.moe_combine",
            "indexer_scores": "kernels.indexer_scores", "moe_gate": "kernels.moe_gate",
            "norm_rope": "kernels.norm_rope", "act_quant": "kernels.act_quant",
            "rms_norm_quant": "kernels.rms_norm_quant", "grouped_linear": "kernels.grouped_linear",
            "compressor_project": "kernels.compressor_project", "sparse_index": "kernels.sparse_index",
            "indexer_weights": "kernels.indexer_weights"}

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise RuntimeError("the tilelang backend needs a CUDA device; use backend='torch' on the CPU")
        self.device = device
        self.missing: list[str] = []
        self._impl = {}
        for op, module in self._OPS.items():
            try:
                self._impl[op] = getattr(importlib.import_module(module), op)
            except (ImportError, AttributeError):
                self.missing.append(op)
                self._impl[op] = getattr(ref, op)

    def fp8_gemm(self, x, w, w_scale):
        return self._impl["fp8_gemm"](x, w, w_scale)

    def act_quant(self, x, block):
        return self._impl["act_quant"](x, block)

    def fp8_gemm_quantized(self, q, s, w, w_scale):
        return self._impl["fp8_gemm_quantized"](q, s, w, w_scale)

    def fp4_gemm(self, x, w, w_scale):
        return self._impl["fp4_gemm"](x, w, w_scale)

    def compressor_project(self, x, w, ape, row, buf_kv, buf_gate):
        self._impl["compressor_project"](x, w, ape, row, buf_kv, buf_gate)

    def grouped_linear(self, x, w, w_scale, groups):
        return self._impl["grouped_linear"](x, w, w_scale, groups)

    def moe_gate(self, x, weight, bias, k, route_scale, hash_ids):
        return self._impl["moe_gate"](x, weight, bias, k, route_scale, hash_ids)

    def swiglu_quant(self, g, u, weights, limit):
        return self._impl["swiglu_quant"](g, u, weights, limit)

    def moe_combine(self, routed, shared, dtype):
        return self._impl["moe_combine"](routed, shared, dtype)

    def indexer_weights(self, x, w, scale):
        return self._impl["indexer_weights"](x, w, scale)

    def sparse_index(self, window_rows, order, visible, k, offset, width):
        return self._impl["sparse_index"](window_rows, order, visible, k, offset, width)

    def sparse_attention(self, q, kv, idx, sink, scale, inverse_rope=None):
        return self._impl["sparse_attention"](q, kv, idx, sink, scale, inverse_rope=inverse_rope)

    def indexer_scores(self, q, keys, weights, visible, scale):
        return self._impl["indexer_scores"](q, keys, weights, visible, scale)

    def fp4_moe(self, x, arena, fields, slots, weights, limit):
        return self._impl["fp4_moe"](x, arena, fields, slots, weights, limit)

    def fp4_moe_quantized(self, q, s, arena, fields, slots, weights, limit, table=None, early=False):
        return self._impl["fp4_moe_quantized"](q, s, arena, fields, slots, weights, limit, table, early)

    def head_logits(self, x, w):
        return self._impl["head_logits"](x, w)

    def rms_norm(self, x, weight, eps):
        return self._impl["rms_norm"](x, weight, eps)

    def rms_norm_quant(self, x, weight, eps):
        return self._impl["rms_norm_quant"](x, weight, eps)

    def rope(self, x, positions, inv_freq, inverse):
        return self._impl["rope"](x, positions, inv_freq, inverse)

    def norm_rope(self, x, weight, eps, positions, inv_freq, round_lead, out=None, rows=None):
        return self._impl["norm_rope"](x, weight, eps, positions, inv_freq, round_lead, out, rows)

    def hadamard_qdq4(self, x, block):
        return self._impl["hadamard_qdq4"](x, block)

    def hc_pre(self, streams, fn, scale, base, n, iters, hc_eps, eps):
        return self._impl["hc_pre"](streams, fn, scale, base, n, iters, hc_eps, eps)

    def hc_post(self, out, streams, post, comb):
        return self._impl["hc_post"](out, streams, post, comb)


def tilelang_available() -> bool:
    """Whether the TileLang package is installed (looked up, not imported)."""
    return importlib.util.find_spec("tilelang") is not None


def make_backend(name: str, device: str | torch.device = "cpu") -> Backend:
    """The backend named by EngineConfig.backend for `device`."""
    device = torch.device(device)
    if name == "torch":
        return TorchBackend()
    if name == "tilelang":
        return TileLangBackend(device)
    raise ValueError(f"unknown kernel backend {name!r}; choose 'torch' or 'tilelang'")


# Every module that defines `@kernel_factory` functions (tests/kernels/test_kernel_factory.py checks the list).
KERNEL_MODULES = ("kernels.act_quant", "kernels.compressor_project", "kernels.fp4_mma_few_tokens",
                  "kernels.fp4_mma_one_token", "kernels.fp4_moe", "kernels.fp8_gemm", "kernels.fp8_mma_one_token",
                  "kernels.grouped_linear", "kernels.hadamard_qdq4", "kernels.head_gemv", "kernels.indexer_scores",
                  "kernels.indexer_weights", "kernels.mhc", "kernels.moe_combine", "kernels.moe_gate",
                  "kernels.norm_rope", "kernels.rms_norm", "kernels.rms_norm_quant", "kernels.rope",
                  "kernels.sparse_attention", "kernels.sparse_index", "kernels.swiglu_quant")


def kernel_modules() -> list[ModuleType]:
    """The modules of KERNEL_MODULES, imported (which imports no TileLang)."""
    return [importlib.import_module(name) for name in KERNEL_MODULES]


def kernel_factories(modules) -> dict[str, KernelFactory]:
    """Qualified name ("kernels.fp8_gemm.fp8_gemv_kernel") -> factory, for every KernelFactory
    defined in `modules` (kernel_modules(), or a test's own)."""
    return {f"{module.__name__}.{attr}": obj for module in modules for attr, obj in vars(module).items()
            if isinstance(obj, KernelFactory) and obj.__module__ == module.__name__}


def compiled_kernels() -> int:
    """Kernel variants built in this process so far: the kernels the `@kernel_factory` functions
    of KERNEL_MODULES have built (each a TileLang compile, or a load from its on-disk cache);
    0 with the torch reference. The engine's "nothing compiles during a chat" is checked against
    this count."""
    return sum(factory.size() for factory in kernel_factories(kernel_modules()).values())

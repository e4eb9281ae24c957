"""Kernel backends: who executes the quantised GEMMs, the sparse attention and the other fused
ops of `native` numerics.

The ops are one table, `OPS`: each declares its name, its pure-torch reference (kernels/
reference.py, whose docstring is the op's contract: shapes, dtypes, rounding) and the TileLang
module that implements it under the same name and leading parameters. A `Backend` is that table
resolved for one device: `torch_backend()` serves every op from the reference (CPU, and any
device torch supports); `tilelang_backend(device)` imports each op's kernel module (on CUDA only;
the modules import TileLang inside their functions, so building the table imports no TileLang).
A kernel module that cannot be imported is an error naming the op, the module and the fix —
never a silent fall back to the slow reference; `Backend.reference_ops` lists the ops the
reference serves (every op on the torch backend, those declared without a kernel on TileLang).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping

import torch

from kernels import reference as ref
from kernels.toolkit import KernelFactory


@dataclass(frozen=True)
class Op:
    """One backend op: `name` (the function's name in the reference and in `kernel`), its
    reference implementation, and the TileLang module defining it (None: the reference serves
    it on every backend)."""

    name: str
    reference: Callable
    kernel: str | None


OPS: tuple[Op, ...] = (
    Op("fp8_gemm", ref.fp8_gemm, "kernels.fp8_gemm"),
    Op("act_quant", ref.act_quant, "kernels.act_quant"),
    Op("fp8_gemm_quantized", ref.fp8_gemm_quantized, "kernels.fp8_gemm"),
    Op("fp4_gemm", ref.fp4_gemm, "kernels.fp4_moe"),
    Op("bf16_gemm", ref.bf16_gemm, "kernels.bf16_gemm"),
    Op("compressor_project", ref.compressor_project, "kernels.compressor_project"),
    Op("compressor_pool", ref.compressor_pool, "kernels.compressor_pool"),
    Op("grouped_linear", ref.grouped_linear, "kernels.grouped_linear"),
    Op("moe_gate", ref.moe_gate, "kernels.moe_gate"),
    Op("swiglu_quant", ref.swiglu_quant, "kernels.swiglu_quant"),
    Op("moe_combine", ref.moe_combine, "kernels.moe_combine"),
    Op("indexer_weights", ref.indexer_weights, "kernels.indexer_weights"),
    Op("sparse_index", ref.sparse_index, "kernels.sparse_index"),
    Op("index_picks", ref.index_picks, "kernels.index_picks"),
    Op("sparse_attention", ref.sparse_attention, "kernels.sparse_attention"),
    Op("indexer_scores", ref.indexer_scores, "kernels.indexer_scores"),
    Op("fp4_moe", ref.fp4_moe, "kernels.fp4_moe"),
    Op("fp4_moe_quantized", ref.fp4_moe_quantized, "kernels.fp4_moe"),
    Op("fp4_dequant_slots", ref.fp4_dequant_slots, "kernels.fp4_dequant"),
    Op("fp8_dequant_bf16", ref.fp8_dequant_bf16, "kernels.fp8_dequant"),
    Op("head_logits", ref.head_logits, "kernels.head_gemv"),
    Op("rms_norm", ref.rms_norm, "kernels.rms_norm"),
    Op("rms_norm_quant", ref.rms_norm_quant, "kernels.rms_norm_quant"),
    Op("rope", ref.rope, "kernels.rope"),
    Op("norm_rope", ref.norm_rope, "kernels.norm_rope"),
    Op("hadamard_qdq4", ref.hadamard_qdq4, "kernels.hadamard_qdq4"),
    Op("hc_pre", ref.hc_pre, "kernels.mhc"),
    Op("hc_post", ref.hc_post, "kernels.mhc"),
    Op("hc_post_pre", ref.hc_post_pre, "kernels.mhc"),
    Op("moe_post_pre", ref.moe_post_pre, "kernels.mhc"),
)
OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)


class KernelImportError(RuntimeError):
    """A TileLang kernel module of an op could not be imported (the message names the fix)."""


class Backend:
    """The table of ops resolved for one device: `backend.<op>(...)` calls the op's
    implementation with the reference's signature. `reference_ops`: the ops the pure-torch
    reference serves. Built by `torch_backend` / `tilelang_backend` (or `make_backend`)."""

    def __init__(self, name: str, impl: Mapping[str, Callable], reference_ops: tuple[str, ...]):
        missing = [op for op in OP_NAMES if op not in impl]
        if missing:
            raise ValueError(f"backend {name!r} lacks the ops {missing}; every op of kernels.backend.OPS needs one")
        self.name = name
        self._impl = dict(impl)
        self.reference_ops = reference_ops

    def __getattr__(self, op: str) -> Callable:
        impl = self.__dict__.get("_impl", {})
        if op not in impl:
            raise AttributeError(f"{type(self).__name__} has no op {op!r}; the ops are kernels.backend.OPS")
        return impl[op]

    def with_ops(self, **ops: Callable) -> "Backend":
        """This backend with some ops replaced (instrumentation: e.g. a test counting calls)."""
        unknown = sorted(set(ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"no such ops {unknown}; the ops are kernels.backend.OPS")
        return Backend(self.name, {**self._impl, **ops}, self.reference_ops)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, reference_ops={len(self.reference_ops)}/{len(OP_NAMES)})"


def torch_backend() -> Backend:
    """Every op from kernels/reference.py (the CPU path, and any device torch supports)."""
    return Backend("torch", {op.name: op.reference for op in OPS}, OP_NAMES)


def tilelang_backend(device: str | torch.device,
                     importer: Callable[[str], ModuleType] = importlib.import_module) -> Backend:
    """Each op from its TileLang kernel module (`importer` imports a module by name); CUDA only.
    Raises KernelImportError naming the op, the module and the fix when a kernel module cannot be
    imported or lacks its op."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("the tilelang backend needs a CUDA device; use backend='torch' on the CPU")
    impl: dict[str, Callable] = {}
    on_reference: list[str] = []
    for op in OPS:
        if op.kernel is None:
            impl[op.name] = op.reference
            on_reference.append(op.name)
            continue
        try:
            module = importer(op.kernel)
        except ImportError as err:
            raise KernelImportError(
                f"the TileLang kernel of op {op.name!r} cannot be imported from {op.kernel} ({err}); "
                "install TileLang (pip install tilelang) and this package's kernels, or choose the torch "
                "reference with --backend torch") from err
        fn = vars(module).get(op.name)
        if not callable(fn):
            raise KernelImportError(
                f"the kernel module {op.kernel} defines no function {op.name!r} for op {op.name!r}; "
                "reinstall the package's kernels, or choose the torch reference with --backend torch")
        impl[op.name] = fn
    return Backend("tilelang", impl, tuple(on_reference))


def tilelang_available() -> bool:
    """Whether the TileLang package is installed (looked up, not imported)."""
    return importlib.util.find_spec("tilelang") is not None


def make_backend(name: str, device: str | torch.device = "cpu") -> Backend:
    """The backend named by EngineConfig.backend for `device`."""
    if name == "torch":
        return torch_backend()
    if name == "tilelang":
        return tilelang_backend(device)
    raise ValueError(f"unknown kernel backend {name!r}; choose 'torch' or 'tilelang'")


# Every module that defines `@kernel_factory` functions (tests/kernels/test_kernel_factory.py checks the list).
KERNEL_MODULES = ("kernels.act_quant", "kernels.compressor_pool", "kernels.compressor_project", "kernels.fp4_dequant",
                  "kernels.fp4_mma_few_tokens", "kernels.fp4_mma_one_token", "kernels.fp4_moe", "kernels.fp8_dequant",
                  "kernels.fp8_gemm", "kernels.fp8_mma_few_tokens", "kernels.fp8_mma_one_token",
                  "kernels.grouped_linear", "kernels.grouped_mma_few_tokens", "kernels.hadamard_qdq4",
                  "kernels.head_gemv", "kernels.index_picks", "kernels.indexer_scores", "kernels.indexer_weights",
                  "kernels.mhc", "kernels.moe_combine", "kernels.moe_gate", "kernels.norm_rope", "kernels.rms_norm",
                  "kernels.rms_norm_quant", "kernels.rope", "kernels.sparse_attention", "kernels.sparse_index",
                  "kernels.swiglu_quant")


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


def built_kernels() -> frozenset[str]:
    """The kernel variants built in this process so far, each named by its factory and arguments
    ("kernels.fp4_moe.fp4_gemv_kernel(1, 2048, ...)"): what `compiled_kernels` counts, so that a
    compile during a chat can be named (the difference of two calls)."""
    return frozenset(f"{name}{args}{dict(kwargs) if kwargs else ''}"
                     for name, factory in kernel_factories(kernel_modules()).items()
                     for args, kwargs in factory.built())

"""Kernel backends on the CPU: the table of ops (kernels.backend.OPS) gives every op a reference
and a kernel module (which the GPU tests run); the TileLang backend resolves each op from its
module and fails loudly when one cannot be imported; native numerics route norms through it."""

import importlib
import inspect
import types

import pytest
import torch

from engine.numerics import Numerics
from kernels import backend as kb
from kernels import reference as ref


def test_every_op_has_a_reference_and_a_kernel_module():
    assert "rms_norm" in kb.OP_NAMES and "fp4_moe" in kb.OP_NAMES
    assert len(set(kb.OP_NAMES)) == len(kb.OPS)  # one declaration per op
    for op in kb.OPS:
        assert op.reference is getattr(ref, op.name)
        assert op.kernel is not None and op.kernel.startswith("kernels.")  # every op has a TileLang kernel module
    torch_ops = kb.torch_backend()
    assert all(getattr(torch_ops, name) is getattr(ref, name) for name in kb.OP_NAMES)
    assert torch_ops.reference_ops == kb.OP_NAMES  # the torch backend is the reference, op by op


def test_a_backend_has_only_the_ops_of_the_table():
    b = kb.torch_backend()
    with pytest.raises(AttributeError, match="no op 'fp16_gemm'"):
        b.fp16_gemm
    with pytest.raises(ValueError, match="lacks the ops"):
        kb.Backend("partial", {"rms_norm": ref.rms_norm}, ())
    with pytest.raises(ValueError, match="no such ops"):
        b.with_ops(fp16_gemm=ref.fp8_gemm)


def test_tilelang_backend_refuses_the_cpu():
    try:
        kb.make_backend("tilelang", "cpu")
    except RuntimeError as err:
        assert "CUDA" in str(err)
    else:
        raise AssertionError("a CPU tilelang backend was built")


def test_tilelang_backend_on_cuda_resolves_every_op_from_its_kernel_module():
    """Building the table imports the kernel modules only (no TileLang, no CUDA call), so a
    (simulated) CUDA device builds it here: every op is its module's function, none on the reference."""
    imported = []

    def importer(name):
        imported.append(name)
        return importlib.import_module(name)

    b = kb.tilelang_backend(torch.device("cuda", 0), importer)
    assert b.name == "tilelang" and b.reference_ops == ()
    for op in kb.OPS:
        assert getattr(b, op.name) is getattr(importlib.import_module(op.kernel), op.name)
    assert set(imported) == {op.kernel for op in kb.OPS}


def test_tilelang_backend_fails_loudly_when_a_kernel_module_cannot_be_imported():
    """On CUDA a kernel module that does not import is an error naming the op, the module and
    the fix (never a silent fall back to the reference)."""

    def importer(name):
        if name == "kernels.sparse_attention":
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return importlib.import_module(name)

    with pytest.raises(kb.KernelImportError) as err:
        kb.tilelang_backend("cuda", importer)
    msg = str(err.value)
    assert "'sparse_attention'" in msg and "kernels.sparse_attention" in msg and "libcuda.so.1" in msg
    assert "--backend torch" in msg and "pip install tilelang" in msg
    assert kb.make_backend("torch", "cuda").reference_ops == kb.OP_NAMES  # the explicit choice of the reference


def test_tilelang_backend_fails_loudly_when_a_kernel_module_lacks_its_op():
    empty = types.ModuleType("kernels.rope")

    def importer(name):
        return empty if name == "kernels.rope" else importlib.import_module(name)

    with pytest.raises(kb.KernelImportError, match="kernels.rope defines no function 'rope' for op 'rope'"):
        kb.tilelang_backend("cuda", importer)


def _counting_norms(counts: list) -> kb.Backend:
    def rms_norm(x, weight, eps):
        counts.append(1)
        return ref.rms_norm(x, weight, eps)

    return kb.torch_backend().with_ops(rms_norm=rms_norm)


def test_native_norms_go_through_the_backend_exact_ones_do_not():
    x, w = torch.randn(3, 64), torch.rand(64)
    norms = []
    counting = _counting_norms(norms)
    native = Numerics.named("native", counting)
    assert torch.equal(native.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert len(norms) == 1
    exact = Numerics.named("exact", counting)
    assert torch.equal(exact.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6))
    assert len(norms) == 1


def test_every_kernel_module_imports_on_the_cpu_and_has_its_op():
    """Kernel modules import torch only (TileLang inside functions): each imports here, without
    TileLang, and defines the function its op maps to, with the reference's parameters."""
    import sys

    for op in kb.OPS:
        fn = getattr(importlib.import_module(op.kernel), op.name)
        want = list(inspect.signature(op.reference).parameters)
        assert list(inspect.signature(fn).parameters)[:len(want)] == want, (op.name, op.kernel)
    assert "tilelang" not in sys.modules


def test_native_engine_ops_route_through_the_backend(tiny_ckpt):
    """The fused ops of a native forward are backend ops (one launch each on CUDA): a backend
    that records which ops are used sees RoPE, mHC pre/post, the indexer's and the MoE's."""
    from engine.model import Transformer
    from engine.weights import open_official

    seen = set()

    class Seen(kb.Backend):
        def __getattribute__(self, name):
            if not name.startswith("_"):
                seen.add(name)
            return object.__getattribute__(self, name)

    files = open_official(tiny_ckpt)
    seeing = Seen("seen", {op.name: op.reference for op in kb.OPS}, kb.OP_NAMES)
    model = Transformer(files.get, files.args, Numerics.named("native", seeing))
    with torch.inference_mode():
        model.forward(torch.arange(9) % files.args.vocab_size, model.new_state(), files.experts)
    assert {"rope", "hc_pre", "hc_post", "hadamard_qdq4", "indexer_scores", "moe_combine", "swiglu_quant",
            "fp8_gemm_quantized", "rms_norm", "sparse_attention", "fp8_gemm", "grouped_linear", "bf16_gemm"} <= seen

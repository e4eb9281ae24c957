"""Kernel backends on the CPU: every Backend op exists in both backends; the TileLang one maps
each op to a kernel module (which the GPU tests import), and native numerics route norms through it."""

import inspect

import torch

from engine.numerics import Numerics
from kernels import backend as kb
from kernels import reference as ref


def _ops(cls) -> set[str]:
    return {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_both_backends_implement_every_op():
    ops = _ops(kb.Backend)
    assert "rms_norm" in ops and "fp4_moe" in ops
    assert ops <= _ops(kb.TorchBackend)
    assert ops <= _ops(kb.TileLangBackend)
    assert set(kb.TileLangBackend._OPS) == ops  # every op has a TileLang kernel module


def test_tilelang_backend_refuses_the_cpu():
    try:
        kb.make_backend("tilelang", "cpu")
    except RuntimeError as err:
        assert "CUDA" in str(err)
    else:
        raise AssertionError("a CPU tilelang backend was built")


class _Counting(kb.TorchBackend):
    def __init__(self):
        self.norms = 0

    def rms_norm(self, x, weight, eps):
        self.norms += 1
        return super().rms_norm(x, weight, eps)


def test_native_norms_go_through_the_backend_exact_ones_do_not():
    x, w = torch.randn(3, 64), torch.rand(64)
    counting = _Counting()
    native = Numerics(native=True, backend=counting)
    assert torch.equal(native.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert counting.norms == 1
    exact = Numerics(native=False, backend=counting)
    assert torch.equal(exact.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6))
    assert counting.norms == 1


def test_every_kernel_module_imports_on_the_cpu_and_has_its_op():
    """Kernel modules import torch only (TileLang inside functions): each imports here, without
    TileLang, and defines the function its op maps to, with the reference's parameters."""
    import importlib
    import sys

    for op, module in kb.TileLangBackend._OPS.items():
        fn = getattr(importlib.import_module(module), op)
        want = list(inspect.signature(getattr(ref, op)).parameters)
        assert list(inspect.signature(fn).parameters)[:len(want)] == want, (op, module)
    assert "tilelang" not in sys.modules


def test_native_engine_ops_route_through_the_backend(tiny_ckpt):
    """The fused ops of a native forward are backend ops (one launch each on CUDA): a backend
    that records which ops are used sees RoPE, mHC pre/post, the indexer's and the MoE's."""
    from engine.model import Transformer
    from engine.weights import open_official

    seen = set()

    class Seen(kb.TorchBackend):
        def __getattribute__(self, name):
            if not name.startswith("_"):
                seen.add(name)
            return object.__getattribute__(self, name)

    files = open_official(tiny_ckpt)
    model = Transformer(files.get, files.args, Numerics(native=True, backend=Seen()))
    with torch.inference_mode():
        model.forward(torch.arange(9) % files.args.vocab_size, model.new_state(), files.experts)
    assert {"rope", "hc_pre", "hc_post", "hadamard_qdq4", "indexer_scores", "moe_combine", "swiglu_quant",
            "fp8_gemm_quantized", "rms_norm", "sparse_attention", "fp8_gemm", "grouped_linear"} <= seen

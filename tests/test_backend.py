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

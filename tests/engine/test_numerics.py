"""The numerics modes are strategies with one op vocabulary (engine/numerics.py): the model's
objects have the same attributes in both modes (weights prepared for the mode at load), the
modes differ by ops and capabilities, not by a flag, and native's ops run on the backend."""

from __future__ import annotations

import pytest
import torch

from engine.linear import FP8Linears
from engine.model import Transformer
from engine.numerics import Exact, FP8Weight, Native, Numerics, Quantized
from engine.weights import open_official
from kernels import backend as kb
from kernels import reference as ref


def _engine_object(v) -> bool:
    return type(v).__module__.startswith("engine.") and not isinstance(v, (Numerics, FP8Weight))


def _attributes(obj, path: str = "model") -> dict[str, str]:
    """path -> type name of every attribute of the model's own objects (engine classes; the
    blocks of a list of them), down to the prepared weights (not into them)."""
    out = {}
    for name, value in vars(obj).items():
        p = f"{path}.{name}"
        out[p] = "Numerics" if isinstance(value, Numerics) else type(value).__name__  # the strategy
        if isinstance(value, list) and value and all(_engine_object(v) for v in value):
            for i, v in enumerate(value):
                out.update(_attributes(v, f"{p}[{i}]"))
        elif _engine_object(value):
            out.update(_attributes(value, p))
    return out


def test_model_objects_have_the_same_attributes_in_both_modes(tiny_ckpt):
    files = open_official(tiny_ckpt)
    try:
        exact = _attributes(Transformer(files.get, files.args, Numerics.named("exact")))
        native = _attributes(Transformer(files.get, files.args, Numerics.named("native")))
    finally:
        files.close()
    assert exact.keys() == native.keys()
    assert "model.blocks[0].ffn.shared" in exact and "model.blocks[0].attn.wq_a_kv" in exact
    assert not any(name.endswith((".ops", ".shared_w13", ".shared_w1", ".weights_proj_w")) for name in exact)
    # the prepared weights differ by mode, the objects holding them do not
    assert exact["model.blocks[0].attn.wq_b.w"] == "Tensor" and native["model.blocks[0].attn.wq_b.w"] == "FP8Weight"
    differ = {k for k in exact if exact[k] != native[k]}
    assert differ and all(k.endswith((".w", ".shared")) for k in differ), differ


def test_the_modes_differ_by_ops_and_capabilities_not_a_flag():
    exact, native = Numerics.named("exact"), Numerics.named("native")
    assert isinstance(exact, Exact) and isinstance(native, Native)
    assert (exact.name, exact.dtype, native.name, native.dtype) == ("exact", torch.float32, "native", torch.bfloat16)
    assert not hasattr(exact, "native") and not hasattr(native, "native")
    assert (exact.batched_experts, exact.decode_graphs) == (False, False)
    assert (native.batched_experts, native.decode_graphs) == (True, True)
    assert exact.reference_ops == native.reference_ops == kb.OP_NAMES  # the torch backend serves every op
    with pytest.raises(ValueError, match="numerics must be 'exact' or 'native'"):
        Numerics.named("fp16")


def test_exact_ops_are_the_reference_and_never_the_backend():
    calls = []

    def counted(name):
        def op(*args, **kwargs):
            calls.append(name)
            return getattr(ref, name)(*args, **kwargs)
        return op

    backend = kb.torch_backend().with_ops(**{name: counted(name) for name in kb.OP_NAMES})
    exact = Numerics.named("exact", backend)
    x, w = torch.randn(3, 256), torch.rand(256)
    assert torch.equal(exact.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert exact.quantize(x) is x and torch.equal(exact.norm_quantized(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert calls == []
    native = Numerics.named("native", backend)
    q = native.norm_quantized(x, w, 1e-6)
    assert isinstance(q, Quantized) and native.quantize(q) is q and calls == ["rms_norm_quant"]


def test_fp8_readers_stack_in_native_when_the_block_scales_stack():
    gen = torch.Generator().manual_seed(0)

    def fp8(n, k):
        w = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
        s = torch.full((-(-n // 128), -(-k // 128)), 2.0 ** -6).to(torch.float8_e8m0fnu)
        return w, s

    a, b = fp8(128, 256), fp8(64, 256)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    native, exact = Numerics.named("native"), Numerics.named("exact")
    stacked = FP8Linears([a, b], native)
    assert [rows for _, rows in stacked.groups] == [[128, 64]]  # one GEMM for both readers
    ya, yb = stacked(x)
    assert torch.equal(ya, ref.fp8_gemm(x, *a)) and torch.equal(yb, ref.fp8_gemm(x, *b))
    assert ya.is_contiguous() and yb.is_contiguous()
    assert [rows for _, rows in FP8Linears([b, a], native).groups] == [[64], [128]]  # 64 rows: no stacking
    assert [rows for _, rows in FP8Linears([a, b], exact).groups] == [[128], [64]]
    ea, eb = FP8Linears([a, b], exact)(x)
    assert torch.equal(ea, ref.matmul(x.float(), ref.dequant_fp8_block(*a).T))
    assert torch.equal(eb, ref.matmul(x.float(), ref.dequant_fp8_block(*b).T))

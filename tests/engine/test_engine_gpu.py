"""The engine on CUDA (native numerics) against the CPU native reference on the tiny model."""

from __future__ import annotations

import pytest
import torch

from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_official
from kernels.backend import make_backend
from oracle import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _logits(ckpt, device: str, backend: str, ids: torch.Tensor, chunks: list[int],
            numerics: str = "native") -> torch.Tensor:
    dev = torch.device(device)
    files = open_official(ckpt, dev)  # experts copied to the device per use
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named(numerics, make_backend(backend, dev)))
    state, out, pos = model.new_state(), [], 0
    with torch.inference_mode():
        for c in chunks:
            out.append(model.forward(ids[pos:pos + c].to(dev), state, files.experts))
            pos += c
    return torch.cat(out).float().cpu()


IDS = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(0))
CHUNKS = [128] + [1] * 32  # prefill, then decode across the HCA emission at 127/128 etc.


def test_gpu_exact_equals_cpu_exact(separated_ckpt):
    """fp32 everywhere: the GPU engine is the CPU engine up to accumulation order."""
    cpu = _logits(separated_ckpt, "cpu", "torch", IDS, CHUNKS, "exact")
    gpu = _logits(separated_ckpt, "cuda", "torch", IDS, CHUNKS, "exact")
    assert rel_err(gpu, cpu).max() <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "tilelang"])
def test_gpu_native_logits_track_cpu_native(separated_ckpt, backend):
    """Native rounds activations to bf16 and FP8 after every GEMM: a last-bit difference in an
    fp32 accumulation (GPU vs CPU order) can move an FP8 code and is then amplified, as the
    official code's own decode-vs-prefill gap shows (§H.3). Measured on the H200 (torch
    backend): median 3.8 % relative; the bound leaves room for the kernels' own order."""
    cpu = _logits(separated_ckpt, "cpu", "torch", IDS, CHUNKS)
    gpu = _logits(separated_ckpt, "cuda", backend, IDS, CHUNKS)
    err = rel_err(gpu, cpu)
    assert err.median() <= 0.1, f"median {err.median():.3e}"
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.8

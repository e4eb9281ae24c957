"""Programmatic dependent launch (kernels/pdl.py) on the GPU (CUDA only; skipped elsewhere).

A PDL kernel starts before its predecessor has finished; it must still read only finished
results. A chain of kernels, each reading what the one before wrote at once, is replayed from a
CUDA graph (where PDL overlaps the links) and must equal the same chain run with a device
synchronisation after every kernel (where nothing overlaps), bit for bit.
"""

import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


def _weights(n: int, k: int, count: int, gen: torch.Generator):
    out = []
    for _ in range(count):
        w = (torch.randn(n, k, generator=gen, device=DEV) * 40).to(torch.float8_e4m3fn)
        s = torch.randint(118, 128, ((n + 127) // 128, k // 128), generator=gen, device=DEV, dtype=torch.uint8)
        out.append((w, s.view(torch.float8_e8m0fnu)))
    return out


@pytest.mark.parametrize("early", [False, True])
def test_decode_kernels_wait_for_their_predecessor(early):
    from kernels import pdl
    from kernels.toolkit import cuda_arch
    from kernels.fp8_gemm import fp8_gemv_kernel
    arch = cuda_arch(torch.device(DEV))
    src = fp8_gemv_kernel(1, 512, 4096, 1, 4, 4, arch, early).get_kernel_source()
    if not pdl.enabled(arch):
        assert "cudaGridDependencySynchronize" not in src
        pytest.skip(f"no PDL on sm_{arch[0]}{arch[1]}")
    # weights only (a prefetch, or with `early` the loads of all the warp's steps) -> wait ->
    # release, in that order, before the first activation load
    wait, release = (src.index(s) for s in ("cudaGridDependencySynchronize();",
                                            "cudaTriggerProgrammaticLaunchCompletion();"))
    first_weight = src.index("W + ") if early else src.index("dsv4_prefetch_l2((")
    assert first_weight < wait < release < src.index("Q + ")
    assert ("dsv4_prefetch_l2((" in src) != early  # the 2 steps per warp are all loaded ahead
    if early:
        assert src[:wait].count("W + ") == src.count("W + ")  # no weight load left after the wait


def test_fp8_mma_one_token_reads_only_weights_before_the_wait():
    from kernels import pdl
    from kernels.toolkit import cuda_arch
    from kernels.fp8_mma_one_token import fp8_mma_one_token_kernel
    arch = cuda_arch(torch.device(DEV))
    if not pdl.enabled(arch):
        pytest.skip(f"no PDL on sm_{arch[0]}{arch[1]}")
    src = fp8_mma_one_token_kernel(4096, 2048, 2, 4, 2, arch).get_kernel_source()
    wait = src.index("cudaGridDependencySynchronize();")
    assert max(src.index("W + "), src.index("SW[")) < wait < min(src.index("Q + "), src.index("SA["))
    assert src.count("Q + ") == src[wait:].count("Q + ")


@pytest.mark.parametrize("early", [False, True])
def test_hc_post_projects_the_comb_before_the_wait_only_when_early(early):
    """Early, only the comb logits (written kernels before: kernels/pdl.py) are read before the
    wait, past L1; the streams, the sub-block's output and post only after it."""
    from kernels import pdl
    from kernels.mhc import hc_post_kernel
    from kernels.toolkit import cuda_arch
    arch = cuda_arch(torch.device(DEV))
    src = hc_post_kernel(4, 4096, 20, 1e-6, "bfloat16", early, arch).get_kernel_source()
    if not pdl.enabled(arch):
        pytest.skip(f"no PDL on sm_{arch[0]}{arch[1]}")
    body = src[src.index("{", src.index("hc_post_kernel(")):]  # after the parameter list
    wait = body.index("cudaGridDependencySynchronize();")
    first_z = re.search(r"\bZ\b", body).start()
    assert min(m.start() for m in re.finditer(r"\b(X|O|Post)\b", body)) > wait
    assert (first_z < wait) == early
    assert ("__ldcg" in body[:wait]) == early


@pytest.mark.parametrize("early", [False, True])
def test_fp4_mma_one_token_reads_the_slot_after_the_wait_unless_early(early):
    """The routed experts' one-token kernel looks its slot up (TABLE[IDS[g]]) after the wait when
    not early: the router just before it writes the ids (a macro argument's loads land where the
    macro is called, so the wait must come first there). Early, they are read before it, past L1."""
    from kernels import pdl
    from kernels.fp4_mma_one_token import fp4_mma_one_token_kernel
    from kernels.toolkit import cuda_arch
    arch = cuda_arch(torch.device(DEV))
    if not pdl.enabled(arch):
        pytest.skip(f"no PDL on sm_{arch[0]}{arch[1]}")
    w_bytes, s_bytes = 2048 * 4096 // 2, 2048 * 4096 // 32
    stride = 2 * (w_bytes + s_bytes)
    src = fp4_mma_one_token_kernel(2048, 4096, stride, (0, w_bytes), stride, (2 * w_bytes, 2 * w_bytes + s_bytes),
                                   2, 4, "bfloat16", arch, lookup=True, early=early).get_kernel_source()
    body = src[src.index("{", src.index("fp4_mma1_kernel(")):]
    wait = body.index("cudaGridDependencySynchronize();")
    first_lookup = min(re.search(rf"\b{name}\b", body).start() for name in ("TABLE", "IDS"))
    assert (first_lookup < wait) == early
    assert ("__ldcg" in body[:wait]) == early
    assert min(m.start() for m in re.finditer(r"\bQ\b", body)) > wait  # the activations: always after


@pytest.mark.parametrize("links", [24])
def test_chain_in_a_graph_equals_the_chain_synchronised(links):
    from kernels.fp8_gemm import fp8_gemm
    from kernels.rms_norm import rms_norm
    gen = torch.Generator(device=DEV).manual_seed(7)
    up, down = _weights(2048, 4096, links, gen), _weights(4096, 2048, links, gen)
    norm_w = torch.rand(4096, generator=gen, device=DEV) + 0.5
    x0 = torch.randn(1, 4096, generator=gen, device=DEV).to(torch.bfloat16)

    def chain(x, sync: bool):
        for (wu, su), (wd, sd) in zip(up, down):
            h = fp8_gemm(x, wu, su)  # reads x, which the previous link's norm just wrote
            if sync:
                torch.cuda.synchronize()
            x = rms_norm(fp8_gemm(h, wd, sd), norm_w, 1e-6)
            if sync:
                torch.cuda.synchronize()
        return x

    want = chain(x0, sync=True).clone()
    static_in = x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_in, sync=False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_in, sync=False)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)


def _routed_chain(ops, x, gate_w, bias, shared, norm_w, arena, fields, table, sync: bool):
    """Links as in the decode's MoE: the router writes the expert ids, the shared expert's GEMV runs
    (it writes neither ids nor table), then the routed experts read the ids early; the next link's
    input depends on both outputs, so the ids change from link to link."""
    def done():
        if sync:
            torch.cuda.synchronize()
    for w, s in shared:
        ids, wts = ops.moe_gate(x, gate_w, bias, 6, 1.0, None)  # [1, 6]
        done()
        q, sq = ops.act_quant(x, 128)
        done()
        h = ops.fp8_gemm(x, w, s)
        done()
        y = ops.fp4_moe_quantized(q, sq, arena, fields, ids[0], wts[0], 10.0, table, early=True)  # [6, D] fp32
        done()
        x = ops.rms_norm((h.float() + y.sum(0, keepdim=True)).to(torch.bfloat16), norm_w, 1e-6)
        done()
    return x


def test_early_expert_reads_in_a_graph_equal_the_chain_synchronised():
    """fp4_moe_quantized(early=True) reads its expert ids and weights before waiting on the kernel
    ahead (kernels/fp4_mma_one_token.py). With the ids written two launches before (as in the decode), a
    graph replay, where PDL overlaps every link, equals the chain synchronised after every call."""
    from kernels.backend import tilelang_backend
    from test_kernels_gpu import _arena
    ops = tilelang_backend(torch.device(DEV))
    gen = torch.Generator(device=DEV).manual_seed(11)
    inter, dim, experts, links = 256, 512, 16, 12
    arena, fields, _ = _arena(experts, inter, dim, gen)
    table = torch.randperm(experts, generator=gen, device=DEV).to(torch.int32)  # expert id -> slot
    gate_w = torch.randn(experts, dim, generator=gen, device=DEV)
    bias = torch.zeros(experts, device=DEV)
    norm_w = torch.rand(dim, generator=gen, device=DEV) + 0.5
    shared = _weights(dim, dim, links, gen)
    args = (gate_w, bias, shared, norm_w, arena, fields, table)
    x0 = torch.randn(1, dim, generator=gen, device=DEV).to(torch.bfloat16)

    want = _routed_chain(ops, x0, *args, sync=True).clone()
    static_in = x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _routed_chain(ops, static_in, *args, sync=False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _routed_chain(ops, static_in, *args, sync=False)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)

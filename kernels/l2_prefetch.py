"""Warm the L2 cache with the head of a weight (TileLang, sm_90+); same contract as `reference.l2_prefetch`.

A one-token decode step alternates big weight reads (wq_b, wo_a, wo_b: 33.5 MB each at Flash's
dimensions; the experts) with chains of small kernels that read little and leave the DRAM idle
(mHC, norms, RoPE, the attention: ~45 µs of a layer's ~135). Launched on a lane beside such a
chain (engine/lanes.py `Lanes.warm`), this kernel starts bulk L2 prefetches
(`cp.async.bulk.prefetch.L2.global`, kernels/pdl.py's SOURCE) of the weight the chain's end
reads, so that read finds part of it in L2 instead of DRAM.

Layout: W is the first `nbytes` bytes of the weight (a multiple of 16) viewed as int32 words
[n], prefetched in requests of SPAN bytes, one per thread, THREADS threads per CTA: a CTA holds no shared memory and few registers, so the chain's kernels
still find room on every SM. A hint: no value anywhere changes. sm_90 tested.
(No `from __future__ import annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import torch

from kernels import pdl
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory

THREADS = 32  # requests per CTA (one warp)
SPAN = 16 << 10  # bytes per request


@kernel_factory
def l2_prefetch_kernel(span: int, arch: tuple[int, int]):
    """(W [n] int32: the words to prefetch, n a multiple of 4): a request of `span` bytes per
    thread, ceil(4n / (span · THREADS)) CTAs."""
    import tilelang.language as T

    n = T.dynamic("n")
    words = span // 4

    @T.prim_func
    def l2_prefetch_main(W: T.Tensor((n,), "int32")):
        with T.Kernel(T.ceildiv(n, words * THREADS), threads=THREADS) as bx:
            T.import_source(pdl.SOURCE)
            start = (bx * THREADS + T.get_thread_binding(0)) * words
            if start < n:
                T.evaluate(T.call_extern("handle", "dsv4_prefetch_l2", T.address_of(W[start]),
                                         T.Cast("uint32", T.min(words, n - start) * 4)))

    return compile_kernel(l2_prefetch_main, arch)


def l2_prefetch(w: torch.Tensor, nbytes: int) -> None:
    """Start an L2 prefetch of the first `nbytes` bytes of `w` (as `reference.l2_prefetch`); on
    architectures without the bulk prefetch (before sm_90) nothing is launched."""
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise KernelInputError("l2_prefetch needs a contiguous tensor on a 16-byte aligned base")
    total = w.numel() * w.element_size()
    if nbytes < 0 or nbytes % 16 or nbytes > total:
        raise KernelInputError(f"l2_prefetch: nbytes={nbytes} must be a multiple of 16 in 0..{total} "
                               "(the tensor's size)")
    arch = cuda_arch(w.device)
    if nbytes and pdl.enabled(arch):
        l2_prefetch_kernel(SPAN, arch)(w.reshape(-1).view(torch.uint8)[:nbytes].view(torch.int32))

"""Programmatic dependent launch (PDL) for the decode kernels (sm_90 and later).

A decode step is a chain of small kernels, each reading what the one before wrote; each kernel
launched after the previous one has drained leaves the GPU idle for microseconds at every link.
With PDL a kernel's CTAs start while its predecessor still runs:

1. they may read weights (never written while kernels run) -- the GEMVs load their first weight
   words into registers or start an L2 prefetch of their rows (`prefetch_rows`), so the DRAM stays
   busy across the link, and the small kernels load their constant operands (norm weights, mHC
   fn's columns, the router's rows and bias), so that their DRAM latency is not on the chain;
2. `begin` then waits (`griddepcontrol.wait`: the predecessor grid has completed and its writes
   are visible) and only afterwards lets this kernel's own dependents launch
   (`griddepcontrol.launch_dependents`).

Releasing before the wait lifts a chain of small reads (bench.ceilings) but did not move the
decode step (H200, 0.90 against 0.89 ms/token; docs/performance-log.md, 2026-12-01), so `begin`
keeps the one order that every kernel may use.

TileLang launches every kernel that calls `T.pdl_sync()` with programmatic stream serialization
(and drops `__restrict__` from its parameters); kernels without it, torch's included, keep the
ordinary full ordering, so a PDL kernel after a torch kernel waits as before.

Rules each kernel keeps (else a race):
* nothing before `begin` reads a buffer any kernel writes, and nothing before it writes. The one
  exception (the `early` of kernels/fp4_mma_one_token.py and kernels/mhc.py's hc_post): a buffer
  that only kernels before the predecessor write (the slot table, the expert ids; mHC's comb
  logits), read past L1 -- this grid starts only once every CTA of its predecessor has passed that
  predecessor's own `begin`, so every earlier kernel has completed;
* every thread of every CTA runs `begin` unconditionally, so no grid can complete before its
  predecessor has: completion stays ordered along the stream (transitively).

On architectures without PDL (`enabled(arch)` false) both helpers emit nothing.
"""

SOURCE = r"""
// Start an L2 prefetch of `bytes` bytes (a multiple of 16) at `p` (16-byte aligned).
__device__ __forceinline__ void dsv4_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
"""


# A kernel prefetches its weight only when the whole weight is at most this large: for 32 MB
# weights the prefetch cost 0.9-4.0 us per call on the H200 (presumably a whole multi-wave grid's
# bulk requests contending with its own loads; docs/performance-log.md).
PREFETCH_MAX_BYTES = 16 << 20


def enabled(arch: tuple[int, int]) -> bool:
    """Whether `arch` has programmatic dependent launch and the bulk L2 prefetch (sm_90+)."""
    return arch[0] >= 9


def prefetches(arch: tuple[int, int], weight_bytes: int) -> bool:
    """Whether a kernel reading a `weight_bytes` weight on `arch` should prefetch it."""
    return enabled(arch) and weight_bytes <= PREFETCH_MAX_BYTES


def begin(T, arch: tuple[int, int]) -> None:
    """Wait for the predecessor grid, then release this grid's dependents (TileLang statements;
    every thread must run them, before the first read of anything a kernel writes)."""
    if enabled(arch):
        T.evaluate(T.pdl_sync())
        T.evaluate(T.pdl_trigger())


def early_read(T, elem, dtype: str, early: bool):
    """Buffer element `elem` (e.g. Z[bs, e]) of type `dtype` as an expression: with `early` (a
    read before `begin`, the exception above) read past L1 (`__ldcg`), since a line an earlier
    kernel cached on this SM must not answer it; else a plain load."""
    return T.call_extern(dtype, "__ldcg", T.address_of(elem)) if early else elem


def prefetch_rows(T, arch: tuple[int, int], weight_bytes: int, elem, nbytes) -> None:
    """Start an L2 prefetch of `nbytes` bytes (a multiple of 16) from buffer element `elem` (a
    16-byte aligned weight element, e.g. W[row, 0]) if `prefetches(arch, weight_bytes)`, where
    `weight_bytes` is the whole weight's size; call it from one thread before `begin`. The kernel
    must import SOURCE (kernels/lowbit.py's `import_source` takes it as extra)."""
    if prefetches(arch, weight_bytes):
        T.evaluate(T.call_extern("handle", "dsv4_prefetch_l2", T.address_of(elem), T.Cast("uint32", nbytes)))

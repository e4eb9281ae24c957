"""The shared toolkit of the TileLang kernel modules: compiling for a device, tile tables,
input checks and small TileLang expression helpers.

TileLang is imported inside functions only: importing any kernels module on a CPU-only machine
imports nothing GPU-related. (Kernel modules leave out `from __future__ import annotations`:
TileLang evaluates the kernel signatures' annotations, which name local variables.)
"""

import functools
import threading

import torch

TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class KernelInputError(ValueError):
    """An input a TileLang kernel cannot take (wrong device, dtype or shape)."""


def cuda_arch(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, e.g. (9, 0) for an H200."""
    if device.type != "cuda":
        raise KernelInputError(f"TileLang kernels need CUDA tensors, got a tensor on {device}; "
                               "use the torch backend on the CPU")
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `index`: a fact of the hardware, looked up once (a
    728-token prefill chunk asks ~1,400 times, and torch's lookup costs microseconds of host time
    each on the path of the chunk's launches)."""
    return torch.cuda.get_device_capability(index)


def tile_params(table: dict, arch: tuple[int, int], default: dict) -> dict:
    """The tile sizes of `table` for `arch` (unknown architectures get `default`)."""
    return table.get(tuple(arch), default)


# TileLang guards every load whose index it cannot bound (a slot read from a table, a dynamic
# row count) with a branch; the GEMVs whose indices are in range by their callers' contract
# compile without, so that their unrolled K loops are straight-line code in which the compiler
# can issue later steps' loads before earlier steps' arithmetic.
UNGUARDED = {"tl.disable_safe_memory_legalize": True}


class KernelFactory:
    """A kernel factory with `functools.cache` semantics (a call with arguments equal to an
    earlier one returns the kernel built then; the arguments must be hashable) that also lists
    the arguments of every kernel it has built, in build order (`built()`), so that a later
    process can build the same set without running the model (engine/kernel_manifest.py).

    Concurrent calls are safe: builds of different arguments run in parallel (the lock guards
    only the table); two threads building equal arguments at once may both build, and both get
    the kernel stored first."""

    def __init__(self, build):
        functools.update_wrapper(self, build)
        self._build = build
        self._kernels: dict = {}
        self._calls: list[tuple[tuple, dict]] = []
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        key = args if not kwargs else args + (_MARK,) + tuple(sorted(kwargs.items()))
        kernel = self._kernels.get(key, _MARK)
        if kernel is _MARK:
            kernel = self._build(*args, **kwargs)
            with self._lock:
                if key not in self._kernels:
                    self._kernels[key] = kernel
                    self._calls.append((args, dict(kwargs)))
                kernel = self._kernels[key]
        return kernel

    def built(self) -> list[tuple[tuple, dict]]:
        """(args, kwargs) of every kernel built so far, in build order."""
        with self._lock:
            return [(args, dict(kwargs)) for args, kwargs in self._calls]

    def size(self) -> int:
        """The number of kernels built so far."""
        return len(self._kernels)


_MARK = object()  # in a cache key: keyword arguments follow; as a lookup result: not built yet


def kernel_factory(build) -> KernelFactory:
    """The decorator of the kernel modules' `*_kernel(...)` factories (see KernelFactory)."""
    return KernelFactory(build)


def compile_kernel(func, arch: tuple[int, int], pass_configs: dict | None = None) -> "Launcher":
    """Compile a TileLang PrimFunc for `arch` = (major, minor); called with every argument, its
    outputs included (`Launcher`)."""
    import tilelang

    target = {"kind": "cuda", "arch": f"sm_{arch[0]}{arch[1]}" + ("a" if arch[0] >= 9 else "")}
    return Launcher(tilelang.compile(func, target=target, pass_configs=pass_configs))


class Launcher:
    """A compiled TileLang kernel (tilelang 0.1.15's `JITKernel`, TVM-FFI execution backend),
    called with all its arguments, outputs included (it allocates none).

    The host module is made ready here, on the thread that compiles or loads the kernel: a kernel
    loaded from TileLang's disk cache has it loaded already; one compiled in this process has a
    `tvm.runtime.Executable` whose host library is built (a host compiler run and a load) when its
    entry is first looked up, which its first call would otherwise do, one kernel at a time on the
    engine's thread in the warm-up. The first call goes through TileLang's adapter, which checks
    the arguments' count; later calls go to the module's entry function directly, without the
    adapter's per-call Python (the argument list rebuilt, outputs looked for, the device
    prepared): a 728-token prefill chunk makes ~1,400 TileLang launches, and its host is what
    bounds it (docs/performance-log.md, 2026-12-03). The entry function converts and checks each
    tensor itself, as it did behind the adapter."""

    def __init__(self, kernel):
        self.kernel = kernel
        # the loaded module, or the Executable: both give the entry by name
        self._main = kernel.adapter.get_exportable_executable()["main"]
        self._entry = None

    def __call__(self, *args) -> None:
        entry = self._entry
        if entry is not None:
            entry(*args)
            return
        self.kernel(*args)
        self._entry = self._main

    def get_kernel_source(self) -> str:
        """The generated CUDA source."""
        return self.kernel.get_kernel_source()


def check_fp4_parts(caller: str, w_row: int, w_offs, s_row: int, s_offs, n: int, k: int) -> None:
    """Raise KernelInputError unless every FP4 weight part [n, k/2] (at byte w_offs[p] of an
    arena row of `w_row` bytes, a multiple of 16) starts 16-byte aligned and ends inside the row,
    and its e8m0 scales [n, k/32] (at byte s_offs[p] of a row of `s_row` bytes) end inside theirs."""
    for w_off, s_off in zip(w_offs, s_offs):
        if w_off % 16 or w_row % 16 or w_off + n * k // 2 > w_row or s_off + n * k // 32 > s_row:
            raise KernelInputError(f"{caller}: the weight must lie inside the arena row at a 16-byte aligned "
                                   "offset (and the arena row length be a multiple of 16), and its scales too")


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """t contiguous on a 16-byte aligned base, which the kernels' 16-byte loads need (a
    misaligned view is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fp32_call(T, name: str, *args):
    """A call of the CUDA fp32 function `name` as a TileLang expression (e.g. `__fmul_rn`: a
    product rounded on its own, which nvcc may not contract into an FMA)."""
    return T.call_extern("float32", name, *args)


def pow2_scale_bits(T, amax):
    """(s, 1/s) as fp32 powers of two with s = 2^ceil(log2(max(amax, 1e-4) / 448)) (TileLang expr)."""
    bits = T.reinterpret(T.max(amax, T.float32(1e-4)), "uint32")
    # e4m3 max 448 = 1.75 * 2^8: mantissa above 0.75 (0x600000) needs one more power of two.
    e = (bits >> T.uint32(23)) - T.uint32(8) + T.Cast("uint32", (bits & T.uint32(0x7FFFFF)) > T.uint32(0x600000))
    s = T.reinterpret(e << T.uint32(23), "float32")
    inv = T.reinterpret((T.uint32(254) - e) << T.uint32(23), "float32")
    return s, inv


def pad_rows_to_bucket(x2: torch.Tensor) -> torch.Tensor:
    """Zero rows appended up to the next power of two: GEMV kernels are compiled per row count,
    so buckets (1, 2, 4, 8, 16) bound the variants a prefill can trigger. Rows are independent,
    so the padding changes no result."""
    m = x2.shape[0]
    bucket = 1 << (m - 1).bit_length()
    return x2 if bucket == m else torch.cat((x2, x2.new_zeros(bucket - m, x2.shape[1])))

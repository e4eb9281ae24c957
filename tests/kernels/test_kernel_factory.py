"""kernels.toolkit.KernelFactory (the `@kernel_factory` decorator of every `*_kernel` factory) and
the factory listing of kernels/backend.py."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from kernels.backend import KERNEL_MODULES, compiled_kernels, kernel_factories, kernel_modules
from kernels.toolkit import KernelFactory, kernel_factory

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_a_factory_caches_like_functools_cache_and_lists_what_it_built():
    builds = []

    @kernel_factory
    def demo_kernel(m: int, arch: tuple[int, int], dtype: str = "bfloat16"):
        """A demo factory."""
        builds.append((m, arch, dtype))
        return object()

    assert isinstance(demo_kernel, KernelFactory)
    assert demo_kernel.__name__ == "demo_kernel" and demo_kernel.__doc__ == "A demo factory."
    a = demo_kernel(4, (9, 0))
    assert demo_kernel(4, (9, 0)) is a  # equal arguments: the kernel built then
    b = demo_kernel(4, (9, 0), dtype="float16")
    c = demo_kernel(4, (9, 0), dtype="bfloat16")  # keyword form: its own entry, as with functools.cache
    assert len({id(a), id(b), id(c)}) == 3
    assert demo_kernel(4, (9, 0), dtype="float16") is b
    assert builds == [(4, (9, 0), "bfloat16"), (4, (9, 0), "float16"), (4, (9, 0), "bfloat16")]
    assert demo_kernel.size() == 3
    assert demo_kernel.built() == [((4, (9, 0)), {}), ((4, (9, 0)), {"dtype": "float16"}),
                                   ((4, (9, 0)), {"dtype": "bfloat16"})]


def test_builds_of_different_arguments_run_in_parallel():
    both_started = threading.Barrier(2, timeout=5)

    @kernel_factory
    def slow_kernel(m: int):
        both_started.wait()  # raises BrokenBarrierError if the two builds were serialised
        return m

    results = {}
    threads = [threading.Thread(target=lambda m=m: results.update({m: slow_kernel(m)}), name=f"test-build-{m}")
               for m in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1: 1, 2: 2} and slow_kernel.size() == 2


def test_kernel_modules_lists_every_module_with_factories():
    with_factories = set()
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.name != "compile_kernel":
                decorators = [ast.unparse(d) for d in node.decorator_list]
                assert decorators == ["kernel_factory"], f"{path.name}: {node.name} is decorated {decorators}"
                with_factories.add(f"kernels.{path.stem}")
    assert set(KERNEL_MODULES) == with_factories
    factories = kernel_factories(kernel_modules())
    assert len(factories) == 34
    assert all(name.rsplit(".", 1)[1].endswith("_kernel") for name in factories)
    assert "kernels.fp8_gemm.fp8_gemv_kernel" in factories and "kernels.mhc.hc_post_kernel" in factories


def test_compiled_kernels_counts_what_the_factories_built():
    # nothing is built on the CPU: the torch backend never calls a factory
    assert compiled_kernels() == sum(f.size() for f in kernel_factories(kernel_modules()).values()) == 0

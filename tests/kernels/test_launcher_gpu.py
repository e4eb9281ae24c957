"""kernels.toolkit.Launcher on real TileLang kernels (CUDA only; skipped elsewhere): a kernel
compiled with TileLang's cache off (its adapter holds a `tvm.runtime.Executable`) and one built
with it on (loaded from the disk cache when an earlier run stored it: a module) both launch
through the adapter once, then through their entry function, with the right results every time."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _add_kernel(n: int, bias: float):
    """Y [n] = X [n] + bias (fp32), compiled for this GPU."""
    import tilelang.language as T

    from kernels.toolkit import compile_kernel, cuda_arch

    @T.prim_func
    def add(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
        with T.Kernel(T.ceildiv(n, 128), threads=128) as bx:
            for i in T.Parallel(128):
                if bx * 128 + i < n:
                    Y[bx * 128 + i] = X[bx * 128 + i] + bias

    return compile_kernel(add, cuda_arch(torch.device("cuda")))


def _launch_three_times(launch) -> None:
    for step in range(3):
        x = torch.arange(300, dtype=torch.float32, device="cuda") * (step + 1)
        y = torch.empty_like(x)
        launch(x, y)
        torch.cuda.synchronize()
        assert torch.equal(y, x + 0.5), step
    assert launch._entry is not None  # the later calls went to the entry function


@pytest.mark.parametrize("cached", [False, True], ids=["cache off", "cache on"])
def test_a_kernel_launches_through_its_entry_function_after_the_first_call(cached):
    import tilelang

    if cached:
        _launch_three_times(_add_kernel(300, 0.5))
        return
    tilelang.disable_cache()  # a fresh compile: its adapter holds a tvm.runtime.Executable
    try:
        launch = _add_kernel(300, 0.5)
    finally:
        tilelang.enable_cache()
    _launch_three_times(launch)

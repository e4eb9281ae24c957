"""kernels.toolkit's input checks, shared by the kernel wrappers, and its `Launcher` (run on the CPU: no kernel is built)."""

from __future__ import annotations

import pytest

from kernels.toolkit import KernelInputError, check_fp4_parts


def test_fp4_parts_outside_the_arena_row_or_misaligned_are_refused_by_name():
    n, k = 4, 64  # a part: 128 weight bytes, 8 scale bytes
    check_fp4_parts("caller", 256, (0, 128), 16, (0, 8), n, k)  # two parts filling both rows exactly
    for w_row, w_offs, s_row, s_offs in ((256, (8, 136), 16, (0, 8)),  # misaligned weight
                                         (250, (0, 112), 16, (0, 8)),  # row length not a multiple of 16
                                         (256, (0, 144), 16, (0, 8)),  # weight past the row's end
                                         (256, (0, 128), 15, (0, 8))):  # scales past theirs
        with pytest.raises(KernelInputError, match="^caller: the weight must lie inside the arena row"):
            check_fp4_parts("caller", w_row, w_offs, s_row, s_offs, n, k)


class _LoadedModule:
    """A kernel loaded from TileLang's cache (`tvm_ffi.Module`): functions by name, `main` the entry."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, name: str):
        assert name == "main"
        return lambda *args: self.calls.append(("entry", args))

    def main(self, *args):
        self.calls.append(("entry", args))


class _Executable:
    """A kernel compiled in this process (`tvm.runtime.Executable`): no `main` attribute; item
    access jit-builds the module and returns its function (it crashed the launcher's entry when
    read as an attribute)."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, name: str):
        assert name == "main"
        return lambda *args: self.calls.append(("entry", args))


class _Adapter:
    executable = None


class _JITKernel:
    """tilelang's JITKernel as `Launcher` uses it: a call through the adapter builds the module."""

    def __init__(self, build=_LoadedModule):
        self.calls: list = []
        self.adapter = _Adapter()
        self.build = build

    def __call__(self, *args):
        self.calls.append(("adapter", args))
        if self.build is not None:
            self.adapter.executable = self.build(self.calls)
        return []


@pytest.mark.parametrize("module", [_LoadedModule, _Executable], ids=["from the cache", "compiled here"])
def test_launcher_calls_through_the_adapter_once_then_the_entry_function(module):
    from kernels.toolkit import Launcher

    kernel = _JITKernel(module)
    launch = Launcher(kernel)
    launch(1, "a")
    launch(2, "b")
    launch(3, "c")
    assert kernel.calls == [("adapter", (1, "a")), ("entry", (2, "b")), ("entry", (3, "c"))]


def test_launcher_stays_on_the_adapter_while_it_has_built_no_module():
    from kernels.toolkit import Launcher

    kernel = _JITKernel(build=None)
    launch = Launcher(kernel)
    launch(1)
    launch(2)
    assert kernel.calls == [("adapter", (1,)), ("adapter", (2,))]

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


class _Executable(_LoadedModule):
    """A kernel compiled in this process (`tvm.runtime.Executable`): item access first builds its
    host library (a host compiler run) and loads it, then returns the function."""

    def __getitem__(self, name: str):
        if ("build", ()) not in self.calls:
            self.calls.append(("build", ()))
        return super().__getitem__(name)


class _Adapter:
    def __init__(self, executable):
        self.executable = executable

    def get_exportable_executable(self):
        return self.executable


class _JITKernel:
    """tilelang's JITKernel as `Launcher` uses it: its adapter holds the module or the Executable;
    a call through the adapter runs the entry after its own checks."""

    def __init__(self, module):
        self.calls: list = []
        self.adapter = _Adapter(module(self.calls))

    def __call__(self, *args):
        self.calls.append(("adapter", args))
        return []


@pytest.mark.parametrize("module", [_LoadedModule, _Executable], ids=["from the cache", "compiled here"])
def test_launcher_readies_the_module_when_made_then_calls_the_adapter_once_then_the_entry(module):
    """The host module is built where the kernel is made (the precompiling threads), not in its
    first call; the first call goes through the adapter, the later ones to the entry."""
    from kernels.toolkit import Launcher

    kernel = _JITKernel(module)
    launch = Launcher(kernel)
    assert kernel.calls == ([("build", ())] if module is _Executable else [])
    kernel.calls.clear()
    launch(1, "a")
    launch(2, "b")
    launch(3, "c")
    assert kernel.calls == [("adapter", (1, "a")), ("entry", (2, "b")), ("entry", (3, "c"))]


def test_the_key_row_ops_refuse_shapes_that_do_not_fit_by_name():
    # checked before any device is asked for: on the CPU, with CPU tensors
    import torch

    from kernels.index_picks import index_picks
    from kernels.sparse_index import sparse_index

    window, visible = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    slots = torch.zeros(2, 16, dtype=torch.long)
    scores = torch.zeros(2, 16)
    cases = [(torch.zeros(3, 16, dtype=torch.long), 4, 4), (slots, 17, 32), (slots, 8, 4)]
    for rows, k, width in cases:  # another query count; k beyond the slots; k beyond the width
        with pytest.raises(KernelInputError, match=r"^sparse_index takes window_rows \[S, W\], order \[S, N\]"):
            sparse_index(window, rows, visible, k, 8, width)
        with pytest.raises(KernelInputError, match=r"^index_picks takes window_rows \[S, W\], scores \[S, N\]"):
            index_picks(rows.float(), window, visible, k, 8, width)
    with pytest.raises(KernelInputError, match="^index_picks takes fp32 scores"):
        index_picks(scores.double(), window, visible, 4, 8, 4)

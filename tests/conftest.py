"""Shared fixtures: synthetic official-format checkpoints written once per test session."""

from __future__ import annotations

import pytest
import torch

from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine.reproducible import pin_cpu_math


def pytest_configure(config):
    pin_cpu_math()  # before the first matrix product: the bitwise comparisons rely on it
    # The tiny models are latency-bound; intra-op threads only add contention on 2 cores.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The §G.1 tiny-v4 checkpoint (4 indexer heads, top-4: indexer ties do happen)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_config(), SynthOptions(seed=0))


@pytest.fixture(scope="session")
def separated_ckpt(tmp_path_factory):
    """Selections cannot flip: index_topk >= every entry count, router bias std 2 (wide margins)."""
    return write_checkpoint(tmp_path_factory.mktemp("sep") / "ckpt", tiny_config(index_topk=512),
                            SynthOptions(seed=1, gate_bias_std=2.0))


@pytest.fixture(scope="session")
def heads16_ckpt(tmp_path_factory):
    """16 indexer heads with top-8: few exact ReLU ties, real top-k selection."""
    return write_checkpoint(tmp_path_factory.mktemp("h16") / "ckpt",
                            tiny_config(index_n_heads=16, index_topk=8), SynthOptions(seed=2))

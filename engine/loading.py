"""Opening a model directory for the engine: its memory plan, its files (weights and expert
provider), the model built on them and the tokenizer. `engine.engine.Engine.load` runs these in
order and owns what they return."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from engine.chat import ChatTokenizer, bundled_tokenizer_dir
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.events import LoadProgress
from engine.memory_plan import MemoryPlan, make_plan, probe_machine
from engine.model import Transformer
from engine.numerics import Numerics


def plan_memory(path: str | Path, config: EngineConfig) -> MemoryPlan:
    """The memory plan for the model at `path` on config.device (engine.memory_plan), made from the
    files' headers before anything is allocated; raises ConfigError when config.max_seq_len is
    beyond the model's context, MemoryPlanError when the plan cannot fit."""
    from engine.weights import model_footprint

    footprint = model_footprint(path)
    footprint.args.check_seq_len(config.max_seq_len, "max_seq_len")
    return make_plan(footprint, config, probe_machine(config.device))


def open_model_files(path: str | Path, config: EngineConfig, plan: MemoryPlan):
    """engine.weights.ModelFiles for `path`: a converted directory (manifest.json) streams its
    experts through a cache of plan.cache bytes on config.device, behind it a host tier of
    plan.host_cache bytes (reads bypass the page cache when the plan forces it, or when the tier
    holds the whole pool: engine.weights.open_converted decides once the tier is pinned); an
    official checkpoint keeps every expert resident in its mmapped shards (copied to a GPU per use)."""
    from engine.weights import open_model

    return open_model(path, cache_bytes=plan.cache, policy=config.cache_policy,
                      io_threads=config.io_threads, o_direct=plan.forced_direct, device=config.device,
                      host_cache_bytes=plan.host_cache, fill_tier=config.fill_host_tier)


def build_model(path: Path, files, config: EngineConfig, report: Callable[[LoadProgress], None]) -> Transformer:
    """The Transformer on `files` (opened from `path`), with config.numerics on config.backend."""
    n = files.args.n_layers
    report(LoadProgress("loading", 0, n, "layers", f"building the model from {path}"))
    device = torch.device(config.device)
    from engine.routing_override import forced_routing
    from kernels.backend import make_backend

    numerics = Numerics.named(config.numerics, make_backend(config.backend, device))
    routing = forced_routing(config.routing_trace, files.args, device,  # timing only (None: the router)
                             config.routing_lookahead)
    model = Transformer(lambda name: files.get(name).to(device), files.args, numerics, routing=routing,
                        lookahead=config.lookahead_prefetch)  # router lookahead: acts only while streaming
    report(LoadProgress("loading", n, n, "layers", "model built"))
    return model


def load_tokenizer(path: Path, vocab_size: int) -> ChatTokenizer:
    """The model directory's tokenizer, else the bundled one; raises EngineError when it has more
    tokens than the model's `vocab_size`."""
    tok_dir = path if (path / "tokenizer.json").is_file() else bundled_tokenizer_dir()
    tokenizer = ChatTokenizer.from_dir(tok_dir)
    if tokenizer.vocab_size > vocab_size:
        raise EngineError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"vocab_size is {vocab_size}; the checkpoint does not fit it")
    return tokenizer

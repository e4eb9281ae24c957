"""The memory plan: how a model's bytes are laid out on a machine, decided before anything is allocated.

    machine = probe_machine("cuda")                 # what the device (and host) can give now
    footprint = engine.weights.model_footprint(path)  # what the model needs, from headers only
    plan = make_plan(footprint, config, machine)     # raises MemoryPlanError when it cannot fit

The plan takes, in order: the resident (non-expert) weights, the session state for
`max_seq_len` (the live state, a working copy, the session's snapshots and the decode graphs'
vacant homes: engine/graph_homes.py), the workspace of the
largest step, the framework's overhead (allocator slack, CUDA graphs, cuBLAS workspaces, kernel
modules) and a safety margin; the expert cache gets what is left of the limit, capped by the
expert pool (the main layers' routed experts: the MTP block's are never routed, see
`ModelFootprint`). The limit is

* discrete GPU (H200): the device's free memory now, or `memory_bytes` if smaller;
* unified memory (CPU runs, DGX Spark / GB10): what keeps the whole machine under
  `UNIFIED_CEILING` of physical memory (what other processes and the kernel use now is counted,
  page cache excepted since it is reclaimable), or `memory_bytes` if smaller. GB10 owners report
  hard lock-ups, not OOM errors, above ~92 %. Expert reads through the page cache would hold the
  same bytes twice on unified memory, so a unified CUDA plan reads experts with O_DIRECT.

`cache_bytes` (``--cache-gb``) fixes the cache instead of "what is left"; it is capped to the
pool. A plan whose fixed parts plus the smallest usable cache (one layer's top-k experts) exceed
the limit is refused with the numbers and the fix. On a discrete GPU with a streamed cache, a
pinned host-RAM tier of the whole expert pool is planned when free host RAM allows
(`HOST_HEADROOM` kept free), else of what it allows; on unified memory there is no second RAM tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.buckets import longest_chunk
from engine.config import EngineConfig, ModelArgs
from engine.graph_homes import HOMES, homes_for
from engine.memory import MemInfo, is_unified, read_meminfo
from engine.state import SequenceState, new_layer_state
from kernels.fp4_moe import EXPERTS_PER_DEQUANT

GiB = 2**30
UNIFIED_CEILING = 0.90  # of physical memory, whole machine
MARGIN_FRACTION = 0.03  # of the limit, kept unplanned
HOST_HEADROOM = 0.15  # of host RAM kept free by the host-RAM tier (at least 4 GiB)


class MemoryPlanError(RuntimeError):
    """The model cannot fit the memory it is given; the message has the numbers and the fix."""


@dataclass(frozen=True)
class Machine:
    """The memory a plan can draw on. Discrete: `total`/`available` are the device's, `host_*`
    the system RAM's; unified: all four describe the one shared pool."""

    device: str
    unified: bool
    total: int
    available: int
    host_total: int
    host_available: int


def probe_machine(device: str | torch.device) -> Machine:
    """The machine's memory now: `torch.cuda.mem_get_info` for a discrete GPU, /proc/meminfo for
    the host (and for the pool of a unified-memory device)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise MemoryPlanError(f"device {device}: only 'cpu' and 'cuda' are supported")
    info = read_meminfo()
    if not is_unified(device):
        free, total = torch.cuda.mem_get_info(device)
        return Machine(str(device), False, total, free, info.total, info.available)
    return unified_machine(str(device), info)


def unified_machine(device: str, info: MemInfo) -> Machine:
    """A unified-memory machine from its /proc/meminfo figures."""
    return Machine(device, True, info.total, info.available, info.total, info.available)


@dataclass(frozen=True)
class ModelFootprint:
    """What a model needs, read from its files' headers (nothing loaded).

    weights: bytes of every tensor but the routed experts (the resident weights, as stored: the
    native numerics keep the checkpoint's FP8/bf16 formats); pool: bytes of the routed experts
    the engine uses, those of the main layers (the MTP block's experts are in the files but never
    routed: the engine does not run the block), as records; record: bytes of one; top_k: experts
    a token uses in one layer; streamed: False for an official checkpoint, whose experts stay in
    the mmapped shards (no expert cache to plan)."""

    args: ModelArgs
    weights: int
    pool: int
    record: int
    top_k: int
    streamed: bool


def state_bytes(args: ModelArgs, max_seq_len: int, dtype: torch.dtype, mtp: bool = False) -> int:
    """Bytes of one sequence state reserved up to position `max_seq_len` (what a turn ending at the
    context limit reserves: `Transformer.reserve`; `mtp`: the model runs its MTP block), computed
    on the meta device with the shapes the model allocates, capacities grown to powers of two."""
    layers = [new_layer_state(args.window_size, args.head_dim, args.ratio(i), args.index_head_dim, dtype, "meta")
              for i in range(args.n_layers)]
    for i, layer in enumerate(layers):
        if args.ratio(i):
            layer.reserve(max_seq_len // args.ratio(i) + 1)
    extra = new_layer_state(args.window_size, args.head_dim, 0, args.index_head_dim, dtype, "meta") if mtp else None
    return SequenceState(layers=layers, mtp=extra).nbytes()


def workspace_bytes(args: ModelArgs, config: EngineConfig) -> int:
    """Transient memory of the largest step: a prefill chunk's residual streams and temporaries
    (8 stream-sized fp32 buffers per token), its routed experts' per-cell temporaries
    (kernels/fp4_moe.py `fp4_moe_dequantized`: the cells' bf16 activations and their dequantised
    copy, w1|w3's bf16 output, w2's FP8 and bf16 inputs, its bf16 output, two fp32 copies of it
    and the MoE's fp32 cells), the buffer of the experts' bf16 weights (w1|w3 of
    EXPERTS_PER_DEQUANT experts, reused for their w2), its attention scores against the longest
    context (fp32, one row per head), and one row of fp32 logits per chunk token."""
    chunk = longest_chunk(config.prefill_chunk)
    streams = chunk * args.hc_mult * args.dim * 4 * 8
    moe = chunk * args.n_activated_experts * (args.dim * (2 + 2 + 2 + 4 + 4 + 4) + args.moe_inter_dim * (4 + 1 + 2))
    dequantised = EXPERTS_PER_DEQUANT * 2 * args.moe_inter_dim * args.dim * 2
    scores = chunk * args.n_heads * min(config.max_seq_len, args.window_size + args.index_topk) * 4
    logits = chunk * args.vocab_size * 4
    return streams + moe + dequantised + scores + logits


# Device memory a captured decode graph set holds outside the caching allocator, per layer
# (H200, 43 layers: 0.14 GiB a set, whole graph or one graph per layer alike).
GRAPH_SET_BYTES_PER_LAYER = 3_500_000
# a decode step's control flows (none, 4, 4 and 128), in one mode (whole or layered)
STEP_SETS = 3
GRAPH_SETS_PER_HOME = 2 * STEP_SETS + 1  # both modes' and the chunk step's (`graph_sets`)


def graph_sets(bounded: bool, guess: bool) -> int:
    """Decode graph sets a home may keep (engine/decode_graph.py): the whole step's three control
    flows, the layered step's three and the chunk step. With every expert resident the layered
    ones come after a flush (the runner streams until the pool is back); through a bounded cache
    the whole ones and the chunk step's come only when steps are guessed whole
    (EngineConfig.guess_whole_steps), else the layered three alone."""
    return GRAPH_SETS_PER_HOME if guess or not bounded else STEP_SETS


def framework_bytes(machine: Machine, n_layers: int, homes: int = HOMES, sets: int = GRAPH_SETS_PER_HOME) -> int:
    """What the framework holds beyond our tensors: on CUDA the caching allocator's slack,
    cuBLAS workspaces and kernel modules (1 GiB) and the graph sets the `homes` graph homes keep
    (engine/graph_homes.py: `sets` per home, `graph_sets`); on the CPU, the interpreter, torch
    and the tokenizer (0.5 GiB)."""
    if not machine.device.startswith("cuda"):
        return GiB // 2
    return GiB + homes * sets * GRAPH_SET_BYTES_PER_LAYER * n_layers


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part; `cache` is the device expert cache (arena), `host_cache` the pinned
    host-RAM tier behind it (0 when none)."""

    machine: Machine
    limit: int
    weights: int
    state: int
    workspace: int
    framework: int
    margin: int
    cache: int
    host_cache: int
    pool: int
    record: int
    cache_fixed: bool  # True when the cache size came from cache_bytes (--cache-gb)
    forced_direct: bool  # expert reads bypass the page cache whatever the tier (--o-direct, unified memory)
    notes: tuple[str, ...] = ()

    @property
    def direct_reads(self) -> bool:
        """Expert reads bypass the page cache: when forced, or when the host tier holds the whole
        pool (it reads each record once; the page cache would hold a second copy)."""
        return self.forced_direct or 0 < self.pool <= self.host_cache

    @property
    def resident(self) -> bool:
        """Every routed expert fits the device cache (nothing streams after the first use)."""
        return self.cache >= self.pool

    @property
    def total(self) -> int:
        """Bytes the plan allots on the device pool (the margin excluded)."""
        return self.weights + self.state + self.workspace + self.framework + self.cache

    @property
    def cache_share(self) -> float:
        return self.cache / self.pool if self.pool else 1.0

    def summary(self) -> str:
        """The plan in one line (the memory pane)."""
        cache = "every expert resident" if self.resident else f"{100 * self.cache_share:.0f} % of the experts"
        host = f" + {_gib(self.host_cache)} host RAM" if self.host_cache else ""
        return (f"plan {_gib(self.total)} of {_gib(self.limit)}: expert cache {_gib(self.cache)}{host} "
                f"({cache})")

    def lines(self) -> list[str]:
        """Human-readable plan, one part a line (printed at load, shown in the memory pane)."""
        kind = "unified memory" if self.machine.unified else f"{self.machine.device} memory"
        cache = "every expert resident" if self.resident else (
            f"{self.cache // self.record} of {self.pool // self.record} experts, {100 * self.cache_share:.0f} % of the pool")
        out = [f"memory plan ({kind}, limit {_gib(self.limit)} of {_gib(self.machine.total)}):",
               f"  resident weights {_gib(self.weights)}",
               f"  session state    {_gib(self.state)}",
               f"  workspace        {_gib(self.workspace)}",
               f"  framework        {_gib(self.framework)}",
               f"  expert cache     {_gib(self.cache)} ({cache}{', fixed by --cache-gb' if self.cache_fixed else ''})"]
        if self.host_cache:
            out.append(f"  host RAM tier    {_gib(self.host_cache)} (pinned, {self.host_cache // self.record} experts)")
        out.append(f"  margin           {_gib(self.margin)}; planned {_gib(self.total)}")
        out += [f"  note: {n}" for n in self.notes]
        return out


def _gib(n: int) -> str:
    """n bytes in GiB: 2 decimals, or 3 significant digits below 0.01 GiB (a tiny model's sizes)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 or n == 0 else f"{n / GiB:.3g} GiB"


def _gib_at_least(n: int) -> str:
    """A GiB figure (3 significant digits, rounded up) that is at least n bytes: for a flag's value."""
    x = n / GiB
    scale = 10.0 ** (2 - math.floor(math.log10(x))) if x > 0 else 1.0
    return f"{math.ceil(x * scale) / scale:.{max(0, round(math.log10(scale)))}f}"


def _check_bytes(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 0):
        raise MemoryPlanError(f"{name} must be a non-negative number of bytes, got {value!r}")


def make_plan(footprint: ModelFootprint, config: EngineConfig, machine: Machine, *,
              max_snapshots: int = 8) -> MemoryPlan:
    """Lay out `footprint` on `machine` under `config` (see the module docstring); raises
    MemoryPlanError with the numbers and the fix when it cannot fit."""
    _check_bytes("cache_bytes", config.cache_bytes)
    _check_bytes("memory_bytes", config.memory_bytes)
    args, notes = footprint.args, []
    if machine.unified:
        limit = int(machine.available - (1 - UNIFIED_CEILING) * machine.total)
        where = f"{UNIFIED_CEILING:.0%} of the machine's {_gib(machine.total)} minus what other processes use"
    else:
        limit = machine.available
        where = f"the free memory of {machine.device}"
    if config.memory_bytes is not None and config.memory_bytes < limit:
        limit, where = config.memory_bytes, "--memory-gb"
    limit = max(0, limit)
    dtype = torch.bfloat16 if config.numerics == "native" else torch.float32
    # + 2: the live state and a working copy; + 2 more: the graph homes' buffers that no state
    # uses (one per capacity, powers of two: together under two states at max_seq_len)
    state = (max_snapshots + 4) * state_bytes(args, config.max_seq_len, dtype)
    workspace = workspace_bytes(args, config)
    homes = homes_for(args, config.max_seq_len)
    framework = framework_bytes(machine, args.n_layers, homes)
    margin = int(MARGIN_FRACTION * limit)
    fixed = footprint.weights + state + workspace + framework + margin
    pool, record = footprint.pool, footprint.record
    bounded = footprint.streamed and (config.cache_bytes < pool if config.cache_bytes is not None
                                      else limit - fixed < pool)
    if bounded:  # the graph sets of a cache smaller than the pool (`graph_sets`)
        fixed -= framework
        framework = framework_bytes(machine, args.n_layers, homes, graph_sets(True, config.guess_whole_steps))
        fixed += framework
    smallest = footprint.top_k * record if footprint.streamed else 0
    if fixed + smallest > limit:
        raise MemoryPlanError(
            f"the model does not fit: resident weights {_gib(footprint.weights)} + session state "
            f"{_gib(state)} (max_seq_len {config.max_seq_len}) + workspace {_gib(workspace)} + framework "
            f"{_gib(framework)} + margin {_gib(margin)} + the smallest expert cache {_gib(smallest)} "
            f"(one layer's {footprint.top_k} experts) = {_gib(fixed + smallest)}, over the {_gib(limit)} "
            f"available ({where}); free memory, lower the context limit (max_seq_len), or raise the "
            "memory limit (--memory-gb)")
    left = limit - fixed
    if not footprint.streamed:
        cache, cache_fixed = pool, False
        notes.append("official checkpoint: experts are read from its mmapped shards (convert it to stream them)"
                     + ("; --cache-gb is ignored" if config.cache_bytes is not None else ""))
    elif config.cache_bytes is not None:
        cache, cache_fixed = config.cache_bytes, True
        if cache > pool:
            notes.append(f"--cache-gb {_gib(config.cache_bytes)} is more than the whole expert pool; "
                         f"capped to {_gib(pool)}")
            cache = pool
        if cache < smallest:
            raise MemoryPlanError(f"--cache-gb {_gib(config.cache_bytes)} holds fewer than one layer's "
                                  f"{footprint.top_k} experts ({_gib(smallest)}); give --cache-gb "
                                  f"{_gib_at_least(smallest)} or more")
        if cache > left:
            raise MemoryPlanError(
                f"--cache-gb {_gib(cache)} does not fit: after the resident weights, state, workspace, "
                f"framework and margin ({_gib(fixed)}) only {_gib(left)} of {_gib(limit)} ({where}) is left; "
                f"lower --cache-gb to {_gib(left)} or less, or leave it out to size the cache automatically")
    else:
        cache, cache_fixed = min(pool, left // record * record), False
    host_cache = 0
    direct = bool(config.o_direct) or (machine.unified and machine.device.startswith("cuda") and footprint.streamed)
    if footprint.streamed and not machine.unified and cache < pool:
        host_left = machine.host_available - max(4 * GiB, int(HOST_HEADROOM * machine.host_total))
        # The tier is inclusive (every record the device reads passes through it), so by default
        # it takes the whole pool when free RAM allows: a tier of only the pool beyond the device
        # cache let misses fall past it to the disk (50 % cache on the H200: 22.6 tok/s, 30.7 with
        # the whole pool, docs/performance-log.md 2026-12-02 05:47). `host_cache_bytes` caps it.
        want = pool if config.host_cache_bytes is None else min(config.host_cache_bytes, pool)
        host_cache = max(0, min(want, host_left)) // record * record
        # Holding the whole pool, the tier reads each record from the disk once: O_DIRECT then
        # (`direct_reads`). A smaller tier keeps buffered reads: the misses that fall past it are
        # then served by the page cache (21.8 tok/s against 16.8 with O_DIRECT, 2026-12-02 04:35).
    return MemoryPlan(machine=machine, limit=limit, weights=footprint.weights, state=state, workspace=workspace,
                      framework=framework, margin=margin, cache=cache, host_cache=host_cache, pool=pool,
                      record=record, cache_fixed=cache_fixed, forced_direct=direct, notes=tuple(notes))


def gib_to_bytes(value: float | None, name: str) -> int | None:
    """A GiB figure from a flag or setting as bytes (None stays None); refuses NaN, inf and
    negative values with one line naming the option."""
    if value is None:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
            or not math.isfinite(value * GiB)):
        raise MemoryPlanError(f"{name} must be a positive number of GiB, got {value!r}")
    return int(value * GiB)


def footprint_of(args: ModelArgs, index, manifest=None) -> ModelFootprint:
    """The footprint of an opened model directory: `index` is its TensorIndex, `manifest` the
    converted layout's manifest (None for an official checkpoint)."""
    if manifest is None:  # official: every expert tensor stays in the shards
        experts = [n for n in index.names() if ".ffn.experts." in n]
        weights = sum(index.info(n).nbytes for n in index.names() if ".ffn.experts." not in n)
        pool = sum(index.info(n).nbytes for n in experts if n.startswith("layers."))  # not mtp.0's
        record = args.expert_record_bytes()
        return ModelFootprint(args, weights, pool, record, args.n_activated_experts, streamed=False)
    weights = sum(index.info(n).nbytes for n in index.names() if not n.endswith(".ffn.experts"))
    return ModelFootprint(args, weights, manifest.pool_bytes(args.n_layers), manifest.record.record_bytes,
                          args.n_activated_experts, streamed=True)

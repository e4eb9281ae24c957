"""End-to-end decode on a CUDA GPU: our engine vs transformers on the same Flash-shaped checkpoint.

    python -m bench.decode_engine [--layers 4] [--prefill 128] [--tokens 32] [--workdir /tmp/dsv4b]

1. writes a `flash`-preset synthetic checkpoint (real dimensions, N layers) under --workdir,
   drawing the random weights on the GPU;
2. our engine, native numerics, every weight and expert resident on the GPU, with the
   `torch` reference backend and with the `tilelang` kernels: prefill, then one token at a time;
3. the same with a converted directory: every expert loaded into the GPU arena and the decode
   step replayed from one CUDA graph (engine.decode_graph, "whole"); then an expert cache of
   25 % of the expert pool, streamed, with one CUDA graph per layer segment ("layered");
4. transformers' DeepseekV4ForCausalLM on the same checkpoint (FP8 dequantised to bf16, since
   its FP8 kernels come from a hub that is unreachable here).
Prints ms/token, bytes touched per token and GB/s against the copy bandwidth of this run, and the
prefill time (after one untimed prefill where experts are resident, so it excludes compilation).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.kernels import copy_bandwidth
from converter.synth import SynthOptions, flash_config, write_checkpoint
from engine.config import EngineConfig
from engine.model import Transformer
from engine.experts.provider import ExpertProvider
from engine.experts.weights import ExpertWeights
from engine.numerics import Numerics
from engine.weights import open_model, open_official
from kernels.backend import make_backend


class GpuResidentExperts(ExpertProvider):
    """Every routed expert uploaded to the GPU once (the 'all resident' case)."""

    def __init__(self, files, n_layers: int, n_experts: int, device: torch.device):
        super().__init__(n_layers, n_experts, files.args.n_activated_experts)
        self.table = {}
        for layer in range(n_layers):
            for e, w in files.experts.experts(layer, list(range(n_experts))):
                self.table[layer, e] = ExpertWeights(*(t.to(device) for t in (
                    w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale)))

    def _experts(self, layer, ids):
        for e in ids:
            yield e, self.table[layer, e]

    def prefetch(self, layer, ids):
        """Nothing to do: all resident."""

    def all_resident(self):
        return True


def _decode(model, experts, ids: torch.Tensor, prefill: int, tokens: int, step=None,
            warmup: int = 2, warm_prefill: bool = False, rounds: int = 1) -> tuple[float, list[float], object,
                                                                                  torch.Tensor]:
    """Greedy: eager prefill, `warmup` untimed steps (compilation, allocator, graph capture), then
    `rounds` timed rounds of `tokens` steps each of `step(state, token) -> logits` (default: the
    eager forward). `warm_prefill`: one untimed prefill on a scratch state first, so that the
    timed one runs compiled kernels (what every prompt after the first sees; for resident experts
    only, since it would also fill an expert cache).
    Returns (prefill seconds, ms per decoded token of each round, the state, the next token)."""
    if step is None:
        def step(st, t):
            return model.forward(t, st, experts, last_only=True)
    state = model.new_state()
    with torch.inference_mode():
        if warm_prefill:
            model.forward(ids[:prefill], model.new_state(), experts, last_only=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(ids[:prefill], state, experts, last_only=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        nxt = logits.argmax(-1)
        for _ in range(warmup):
            nxt = step(state, nxt).argmax(-1)
    per_round, nxt = _rounds(step, state, nxt, tokens, rounds)
    return t1 - t0, per_round, state, nxt


def _rounds(step, state, nxt: torch.Tensor, tokens: int, rounds: int, read_back: bool = False
            ) -> tuple[list[float], torch.Tensor]:
    """ms per token of each of `rounds` timed rounds of `tokens` greedy steps. The next token
    stays on the device (the host may run ahead of the GPU), or with `read_back` is read on the
    host after every step before the next is launched (the app's loop, which launches the next
    step first, is timed by `_engine_turns`)."""
    per_round = []
    with torch.inference_mode():
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(tokens):
                nxt = step(state, nxt).argmax(-1)
                if read_back:
                    nxt = torch.tensor([int(nxt)], device=nxt.device)
            torch.cuda.synchronize()
            per_round.append((time.perf_counter() - t) * 1e3 / tokens)
    return per_round, nxt


def _profile(step, nxt: torch.Tensor, steps: int = 4, every: bool = False) -> None:
    """Where a decode step's time goes: GPU kernel time vs wall time (launch + Python gaps).

    `step(token) -> logits` runs one decode step (eager forward, or a graph replay); `every`
    lists every kernel by GPU time (else the top 12)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.op_profile import cuda_kernels, kernel_table

    with torch.inference_mode():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                nxt = step(nxt).argmax(-1)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / steps
    kernels = cuda_kernels(prof)
    print(f"profile: wall {wall * 1e3:.2f} ms/token; by GPU time:")
    print("\n".join(kernel_table(prof, steps, None if every else 12, host_top=10)))
    print("  by launches:")
    for e in sorted(kernels, key=lambda e: -e.count)[:15]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  x{e.count // steps:4d}  {e.key[:90]}")
    # TileLang names its kernels `<prim_func>_kernel`; the rest (torch's, cuBLAS, copies) launch
    # without programmatic dependent launch, so each waits for the kernel before it to finish
    others = [e for e in kernels if not e.key.endswith("_kernel")]
    print(f"  outside TileLang (no PDL overlap): {sum(e.count for e in others) / steps:.0f} per token")
    for e in sorted(others, key=lambda e: -e.count)[:8]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  x{e.count / steps:5.2f}  {e.key[:90]}")


def _hf_decode(path: Path, ids: torch.Tensor, prefill: int, tokens: int) -> tuple[float, float, float]:
    from transformers import AutoModelForCausalLM, DynamicCache, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16,
        attn_implementation="eager", device_map="cuda").eval()
    gib = torch.cuda.memory_allocated() / 2**30
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids[:prefill].unsqueeze(0), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for _ in range(tokens):
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
    del model
    torch.cuda.empty_cache()
    return t1 - t0, (t3 - t2) * 1e3 / tokens, gib


def _graphed(ckpt: Path, ids: torch.Tensor, a, dev: torch.device) -> list[tuple[str, float, float]]:
    """Converted directory; (1) every expert in the GPU arena, one graph per step; (2) a cache of
    25 % of the expert pool, one graph per layer segment, misses streamed from disk."""
    from converter.convert import convert
    from engine.decode_graph import DecodeRunner

    out = Path(a.workdir) / f"flash{a.layers}-pack"
    if not (out / "manifest.json").exists():
        t = time.perf_counter()
        convert(ckpt, out)
        print(f"converted in {time.perf_counter() - t:.1f} s")
    rows = []
    runs = [(1.0, "all resident, CUDA graph per step", 1)]
    if not a.skip_stream:
        runs += [(0.25, f"25 % expert cache, graph per layer, {n} I/O threads", n) for n in a.io_threads]
    for share, label, threads in runs:
        files = open_model(out, device=str(dev))
        budget = int(files.experts.cache.capacity_bytes * share)
        if share < 1.0:
            files.close()
            files = open_model(out, cache_bytes=budget, io_threads=threads, device=str(dev))
        t = time.perf_counter()
        whole = files.experts.load_all()
        print(f"{label}: load_all -> {whole} in {time.perf_counter() - t:.1f} s")
        model = Transformer(lambda n: files.get(n).to(dev), files.args,
                            Numerics.named("native", make_backend("tilelang", dev)))
        runner = DecodeRunner(model, files.experts, whole=whole)
        pre, per_round, state, nxt = _decode(model, files.experts, ids, a.prefill, a.tokens, runner.step, warmup=3,
                                             warm_prefill=whole, rounds=a.rounds)
        ms = statistics.median(per_round)
        print(f"  decode {ms:.2f} ms/token (median of {len(per_round)} rounds of {a.tokens} tokens: "
              f"{', '.join(f'{r:.2f}' for r in per_round)}); graph captures: {runner.captures}")
        synced, nxt = _rounds(runner.step, state, nxt, a.tokens, a.rounds, read_back=True)
        print(f"  decode waiting for each token on the host before the next launch "
              f"{statistics.median(synced):.2f} ms/token ({', '.join(f'{r:.2f}' for r in synced)})")
        _profile(lambda t: runner.step(state, t), nxt, every=a.kernel_table)
        runner.settle()  # the last step's routes, for the statistics
        st = files.experts.stats()
        print(f"  hit rate {st.hit_rate:.3f} (incl. prefill), bytes read {st.bytes_read / 2**30:.2f} GiB, "
              f"evictions {st.evictions}")
        rows.append((f"ours native, tilelang, {label}", pre, ms))
        del model
        files.close()
        torch.cuda.empty_cache()
    if not a.skip_engine:
        rows.extend(_engine_turns(out, a, EngineConfig(device=str(dev), backend="tilelang", cuda_graphs=True)))
    return rows


def _engine_turns(pack: Path, a, config: EngineConfig) -> list[tuple[str, float, float]]:
    """The app's own loop: `Engine.generate` on the converted directory (on the GPU: every expert
    resident, CUDA graphs, the bundled tokenizer), sampling at temperature 0.6 with a seed, each token
    read on the host, detokenised and checked for stops while the next step runs. Three turns
    of one session; the first compiles and captures, so the rows take the median of the others:
    wall time after prefill per token (with any graph re-capture a turn needs when the state's
    caches grow), and the median step (the steady state)."""
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams

    per_token, medians = [], []
    with Engine.load(pack, config) as eng:
        session = eng.new_session()
        runner = eng.runtime.runner

        def captures() -> int:  # decode graph sets captured so far (none: decoding eagerly)
            return runner.captures if runner is not None else 0

        for turn in range(3):
            before = captures()
            t = time.perf_counter()
            events = list(eng.generate(session, f"Turn {turn}: tell me about the sea.",
                                       SamplingParams(temperature=0.6, seed=turn, max_tokens=4 * a.tokens)))
            wall = time.perf_counter() - t
            done = [e for e in events if isinstance(e, TurnFinished)]
            if not done:
                raise SystemExit(f"bench.decode_engine: engine turn {turn} failed: {events[-1]}")
            st = done[0].stats
            steps = sorted(st.step_ms)
            ms = 1e3 * (wall - st.prefill_s) / st.completion_tokens
            median = steps[len(steps) // 2]
            slow = [x for x in st.step_ms if x > 3 * median]
            print(f"  engine turn {turn}: {st.completion_tokens} tokens ({st.finish_reason}), {st.tok_per_s:.0f} tok/s "
                  f"(median step {median:.2f} ms), wall after prefill {ms:.2f} ms/token; positions "
                  f"{st.prompt_tokens}..{st.prompt_tokens + st.completion_tokens}, graph captures "
                  f"{captures() - before}, steps over 3x the median: "
                  f"{len(slow)} ({sum(slow):.0f} ms in all)")
            if turn:
                per_token.append(ms)
                medians.append(median)
    name = "ours native, Engine.generate (the app's loop), all resident"
    return [(f"{name}, wall after prefill", float("nan"), statistics.median(per_token)),
            (f"{name}, median step", float("nan"), statistics.median(medians))]


def _bytes_per_token(files, n_layers: int) -> int:
    """Resident weights read per decode token (all but the embedding) + 6 experts per layer."""
    idx = files.index
    resident = sum(idx.info(n).nbytes for n in idx.names()
                   if ".experts." not in n and not n.startswith("mtp.") and n != "embed.weight")
    return resident + n_layers * files.args.n_activated_experts * files.args.expert_record_bytes()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds of --tokens steps for the CUDA-graph runs (the median is reported)")
    p.add_argument("--workdir", default="/tmp/dsv4b")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--backends", default="tilelang,torch",
                   help="comma-separated kernel backends to time eagerly (empty: none)")
    p.add_argument("--skip-graph", action="store_true", help="skip the converted CUDA-graph runs")
    p.add_argument("--skip-stream", action="store_true", help="skip the 25 %% expert-cache (streamed) run")
    p.add_argument("--skip-engine", action="store_true", help="skip the Engine.generate turns (the app's loop)")
    p.add_argument("--kernel-table", action="store_true",
                   help="list every kernel of the CUDA-graph step by GPU time (default: the top 12)")
    p.add_argument("--io-threads", type=lambda v: [int(n) for n in v.split(",")], default=[EngineConfig.io_threads],
                   help="comma-separated I/O thread counts, one streamed run each (default: EngineConfig's)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.decode_engine needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    ckpt = Path(a.workdir) / f"flash{a.layers}"
    if not (ckpt / "model.safetensors.index.json").exists():
        t = time.perf_counter()
        write_checkpoint(ckpt, flash_config(a.layers), SynthOptions(seed=0, device="cuda", with_mtp=False,
                                                                    tokenizer=False))
        print(f"synthetic flash checkpoint, {a.layers} layers: {time.perf_counter() - t:.1f} s")
    bw = copy_bandwidth(dev) / 1e9  # GB/s, read + write counted (as in DESIGN §5)
    files = open_official(ckpt)
    args = files.args
    ids = torch.randint(0, args.vocab_size, (a.prefill,), generator=torch.Generator().manual_seed(0)).to(dev)
    per_token = _bytes_per_token(files, args.n_layers)
    roofline_ms = per_token / (bw * 1e9) * 1e3
    print(f"HBM copy {bw:.0f} GB/s (read+write); bytes touched per token {per_token / 2**20:.1f} MiB; "
          f"roofline {roofline_ms:.3f} ms/token")
    backends = [b for b in a.backends.split(",") if b]
    experts = GpuResidentExperts(files, args.n_layers, args.n_routed_experts, dev) if backends else None
    rows = []
    for backend in backends:
        model = Transformer(lambda n: files.get(n).to(dev), args, Numerics.named("native", make_backend(backend, dev)))
        pre, (ms,), _, _ = _decode(model, experts, ids, a.prefill, a.tokens, warm_prefill=True)
        rows.append((f"ours native, {backend}, all resident", pre, ms))
        if backend == "tilelang":
            state = model.new_state()
            with torch.inference_mode():
                nxt = model.forward(ids[:16], state, experts, last_only=True).argmax(-1)
            _profile(lambda t: model.forward(t, state, experts, last_only=True), nxt)
        del model
        torch.cuda.empty_cache()
    del experts
    torch.cuda.empty_cache()
    if not a.skip_graph:
        rows.extend(_graphed(ckpt, ids, a, dev))
    if not a.skip_hf:
        pre, ms, gib = _hf_decode(ckpt, ids, a.prefill, a.tokens)
        print(f"transformers: decode {ms:.2f} ms/token")
        rows.append((f"transformers bf16-dequantised ({gib:.0f} GiB)", pre, ms))
    # prefill: after one untimed prefill where experts are resident (compiled kernels), cold otherwise
    print(f"| run | prefill {a.prefill} s | decode ms/token | GB/s | % of copy bw | vs transformers |")
    hf_ms = rows[-1][2] if not a.skip_hf else None
    for name, pre, ms in rows:
        gbs = per_token / (ms * 1e-3) / 1e9
        ratio = f"{hf_ms / ms:.2f}x" if hf_ms else "-"
        pre_s = "-" if pre != pre else f"{pre:.3f}"  # nan: not timed
        print(f"| {name} | {pre_s} | {ms:.2f} | {gbs:.0f} | {100 * gbs / bw:.1f}% | {ratio} |")
    files.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

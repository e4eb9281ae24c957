"""Decode-step cost of Flash-shaped layers through the TileLang kernels, vs the HBM roofline.

Run on a CUDA machine:  python -m bench.decode [--layers 4]
This is the kernel-level part of issue 6's decode benchmark: it builds `--layers` CSA-type
DeepSeek-V4-Flash layers with random weights in their serving formats (resident FP8 dense
weights, bf16 wo_a and gate, an expert arena of FP4 records) and times one token's pass over
them: q/kv/indexer projections, sparse attention over 128 window + 512 selected rows, grouped
wo_a + wo_b, gate, shared expert and 6 routed experts read from arena slots. Norms, RoPE, mHC,
the compressor/indexer scoring and the routing top-k are left out (small elementwise work),
and so is the full engine (checkpoint, conversion, cache policy, transformers baseline): that
end-to-end measurement is bench/decode_engine.py.

Reported: bytes touched per token per layer, ms per layer (eager = launch-bound, and CUDA-graph
replay), achieved GB/s as a fraction of the device-to-device copy bandwidth measured in the
same run, and the per-token figures extrapolated to 43 layers.
"""

import argparse

import torch

from bench.kernels import _fp8, copy_bandwidth, median_seconds

DIM, HEADS, HEAD_DIM, Q_RANK, INTER, N_EXPERTS, TOPK = 4096, 64, 512, 1024, 2048, 256, 6
IDX_HEADS, IDX_DIM, GROUPS, O_RANK, WINDOW, SELECTED = 64, 128, 8, 1024, 128, 512
FULL_LAYERS = 43


class _Field:
    def __init__(self, offset, shape):
        self.offset, self.shape = offset, shape


def expert_arena(slots: int, dev) -> tuple[torch.Tensor, dict]:
    """uint8 [slots, record] of FP4 expert records (w1, w1.scale, w3, w3.scale, w2, w2.scale)."""
    shapes = {"w1.weight": (INTER, DIM // 2), "w1.scale": (INTER, DIM // 32), "w3.weight": (INTER, DIM // 2),
              "w3.scale": (INTER, DIM // 32), "w2.weight": (DIM, INTER // 2), "w2.scale": (DIM, INTER // 32)}
    fields, off = {}, 0
    for name, shp in shapes.items():
        fields[name] = _Field(off, shp)
        off += shp[0] * shp[1]
    data = torch.randint(0, 256, (slots, -(-off // 4096) * 4096), device=dev, dtype=torch.uint8)
    for name, f in fields.items():
        if name.endswith("scale"):
            n = f.shape[0] * f.shape[1]
            data[:, f.offset:f.offset + n] = torch.randint(118, 128, (slots, n), device=dev, dtype=torch.uint8)
    return data, fields


class Layer:
    """One CSA layer's decode-time weights and the token step through them."""

    def __init__(self, dev, arena, fields):
        self.wq_a, self.wq_b = _fp8(Q_RANK, DIM, dev), _fp8(HEADS * HEAD_DIM, Q_RANK, dev)
        self.wkv, self.idx_wq_b = _fp8(HEAD_DIM, DIM, dev), _fp8(IDX_HEADS * IDX_DIM, Q_RANK, dev)
        self.wo_a = (torch.randn(GROUPS, O_RANK, HEADS // GROUPS * HEAD_DIM, device=dev) * 0.02).to(torch.bfloat16)
        self.wo_b = _fp8(DIM, GROUPS * O_RANK, dev)
        self.gate = torch.randn(N_EXPERTS, DIM, device=dev) * 0.02  # fp32 (official upcasts)
        self.sh1, self.sh3, self.sh2 = _fp8(INTER, DIM, dev), _fp8(INTER, DIM, dev), _fp8(DIM, INTER, dev)
        self.sink = torch.randn(HEADS, device=dev)
        self.kv_cache = torch.randn(WINDOW + 4 * SELECTED, HEAD_DIM, device=dev).to(torch.bfloat16)
        self.idx = torch.randperm(self.kv_cache.shape[0], device=dev)[:WINDOW + SELECTED].view(1, -1)
        self.arena, self.fields = arena, fields
        self.slots = torch.randperm(arena.shape[0], device=dev)[:TOPK].to(torch.int32)

    def resident_bytes(self) -> int:
        fp8 = [self.wq_a, self.wq_b, self.wkv, self.idx_wq_b, self.wo_b, self.sh1, self.sh3, self.sh2]
        return (sum(w.numel() + s.numel() for w, s in fp8) + self.wo_a.numel() * 2 + self.gate.numel() * 4
                + self.idx.shape[1] * HEAD_DIM * 2)

    def expert_bytes(self) -> int:
        return TOPK * sum(f.shape[0] * f.shape[1] for f in self.fields.values())

    def step(self, x: torch.Tensor, ops: dict) -> torch.Tensor:
        """x [1, DIM] bf16 -> [1, DIM]; `ops` = {'fp8_gemm', 'sparse_attention', 'fp4_moe'}."""
        fp8 = ops["fp8_gemm"]
        c = fp8(x, *self.wq_a)
        q = fp8(c, *self.wq_b).view(1, HEADS, HEAD_DIM)
        fp8(x, *self.wkv)
        fp8(c, *self.idx_wq_b)
        o = ops["sparse_attention"](q, self.kv_cache, self.idx, self.sink, HEAD_DIM ** -0.5)
        u = o.to(torch.bfloat16).view(GROUPS, 1, -1)  # [G, 1, 8 heads * 512]
        z = torch.bmm(u, self.wo_a.transpose(1, 2)).view(1, GROUPS * O_RANK)
        h = fp8(z, *self.wo_b)
        scores = h.float() @ self.gate.T  # router logits (top-k left out: the slots are fixed)
        g, u3 = fp8(h, *self.sh1).float(), fp8(h, *self.sh3).float()
        shared = fp8((torch.nn.functional.silu(g) * u3).to(torch.bfloat16), *self.sh2).float()
        w = torch.softmax(scores[0, :TOPK], -1)
        routed = ops["fp4_moe"](h.expand(TOPK, DIM), self.arena, self.fields, self.slots, w, 10.0)
        return (routed.sum(0, keepdim=True) + shared).to(torch.bfloat16)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="Flash-shaped layers to build (default 4)")
    ap.add_argument("--slots", type=int, default=64, help="expert arena slots (default 64)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode needs a CUDA GPU")
    from kernels.fp4_moe import fp4_moe
    from kernels.fp8_gemm import fp8_gemm
    from kernels.sparse_attention import sparse_attention

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev))
    ceiling = copy_bandwidth(dev)
    arena, fields = expert_arena(a.slots, dev)
    layers = [Layer(dev, arena, fields) for _ in range(a.layers)]
    ops = {"fp8_gemm": fp8_gemm, "sparse_attention": sparse_attention, "fp4_moe": fp4_moe}
    x = torch.randn(1, DIM, device=dev).to(torch.bfloat16)

    def token():
        h = x
        for layer in layers:
            h = layer.step(h, ops)
        return h

    token()
    torch.cuda.synchronize()
    eager = median_seconds(token)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        token()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token()
    graphed = median_seconds(graph.replay)

    res, exp = layers[0].resident_bytes(), layers[0].expert_bytes()
    per_layer = res + exp
    print(f"HBM device-to-device copy: {ceiling / 1e9:.0f} GB/s (read + write)")
    print(f"layers timed: {a.layers} (CSA-shaped); arena: {a.slots} slots x {arena.shape[1] / 2**20:.2f} MiB")
    print(f"bytes per layer per token: resident {res / 2**20:.1f} MiB + 6 experts {exp / 2**20:.1f} MiB "
          f"= {per_layer / 2**20:.1f} MiB")
    print(f"| {'mode':14s} | {'ms/layer':>8s} | {'GB/s':>6s} | {'% copy':>6s} | {'ms/token @43 layers':>19s} | "
          f"{'roofline ms/token':>17s} |")
    print(f"|{'-' * 16}|{'-' * 10}|{'-' * 8}|{'-' * 8}|{'-' * 21}|{'-' * 19}|")
    for mode, t in (("eager", eager), ("cuda graph", graphed)):
        tl = t / a.layers
        print(f"| {mode:14s} | {tl * 1e3:8.3f} | {per_layer / tl / 1e9:6.0f} | {100 * per_layer / tl / ceiling:5.1f}% | "
              f"{tl * FULL_LAYERS * 1e3:19.2f} | {per_layer * FULL_LAYERS / ceiling * 1e3:17.2f} |")


if __name__ == "__main__":
    main()

"""Shape buckets: the finite set of shapes a chat can give the kernels, so each compiles once.

TileLang kernels are compiled per static shape (rows of a GEMV, a compressed cache's capacity,
...), and a compile on the H200 takes seconds. The engine therefore never hands the kernels a
shape outside these buckets:

* prefill chunk lengths: a prompt of n tokens runs as full chunks of `chunk` tokens and then its
  remainder in one chunk when it has more than GEMV_MAX_M (16) tokens: above that row count every
  kernel a chunk reaches takes its length at run time (dynamic shapes, cuBLAS, the torch
  reference), so any length compiles nothing new, and each chunk costs a fixed dequantisation of
  the weights (kernels/fp4_moe.py, kernels/fp8_gemm.py) that one chunk pays once. A remainder of
  16 tokens or fewer joins the first full chunk (`longest_chunk`: chunk + 16 tokens at most) or,
  without one, is split into powers of two, largest first (13 -> 8, 4, 1): those rows reach the
  GEMV kernels, compiled per row count. Chunked prefill equals whole prefill, so the split
  changes no result (bit for bit on the CPU with its math pinned: engine/numerics.py, "Chunking");
* compressed-cache capacities: powers of two from `engine.state.MIN_ENTRIES` up to what
  `max_seq_len` needs (`engine.state.LayerState.reserve` grows them that way);
* rows of a one-launch GEMV: padded to powers of two by the kernels (kernels.act_quant);
* rows of the cuBLAS GEMMs whose algorithm choice per new row count costs milliseconds: padded
  to multiples of `kernels.bf16_gemm.CUBLAS_ROW_BUCKET` (`cublas_rows`), and `chunk_buckets`
  holds a chunk length for each of those row counts up to `longest_chunk`.

The warm-up at load (engine/warmup.py) runs every one of them once.
"""

from __future__ import annotations

from engine.config import ModelArgs
from engine.state import MIN_ENTRIES
from kernels.bf16_gemm import CUBLAS_ROW_BUCKET, cublas_rows
from kernels.fp8_gemm import GEMV_MAX_M


def chunk_lengths(n: int, chunk: int) -> list[int]:
    """Lengths of the chunks that prefill n tokens: full chunks, then the remainder in one chunk
    when it is longer than GEMV_MAX_M; a shorter one joins the first full chunk (a whole chunk's
    fixed cost saved for at most GEMV_MAX_M more rows), or without one is split into its powers
    of two."""
    if chunk < 1 or n < 0:
        raise ValueError(f"chunk must be >= 1 and n >= 0, got chunk={chunk}, n={n}")
    full, rest = divmod(n, chunk)
    out = [chunk] * full
    if rest > GEMV_MAX_M:
        return out + [rest]
    if full and chunk > GEMV_MAX_M:  # a full chunk of dynamic shapes takes the few rows more
        out[0] += rest
        return out
    bit = 1 << max(0, rest.bit_length() - 1)
    while rest:
        if rest & bit:
            out.append(bit)
            rest -= bit
        bit >>= 1
    return out


def longest_chunk(chunk: int) -> int:
    """The most tokens one prefill chunk of `chunk_lengths(·, chunk)` has (what the memory plan
    reserves a chunk's workspace for)."""
    return chunk + GEMV_MAX_M if chunk > GEMV_MAX_M else chunk


def chunk_buckets(chunk: int) -> list[int]:
    """The chunk lengths the warm-up runs, largest first: `chunk` and every power of two below it
    (every length up to GEMV_MAX_M that `chunk_lengths` can produce, and representatives of the
    longer ones, whose kernels take any length), and a length for each row count of the cuBLAS
    GEMMs (`cublas_rows`) up to `longest_chunk` that those leave out (its first call chooses
    cuBLAS's algorithm)."""
    out = [chunk]
    bit = 1 << max(0, (chunk - 1).bit_length() - 1)
    while bit:
        if bit < chunk:
            out.append(bit)
        bit >>= 1
    longest = longest_chunk(chunk)
    covered = {cublas_rows(n) for n in out}
    for rows in range(CUBLAS_ROW_BUCKET, cublas_rows(longest) + 1, CUBLAS_ROW_BUCKET):
        if rows not in covered:
            out.append(min(rows, longest))
    return sorted(out, reverse=True)


def capacity_buckets(max_seq_len: int, ratio: int) -> list[int]:
    """Capacities (compressed entries) a layer of compression `ratio` passes through up to
    position `max_seq_len`, smallest first (`LayerState.reserve`: powers of two, at least
    MIN_ENTRIES)."""
    need = max_seq_len // ratio + 1
    out, cap = [], MIN_ENTRIES
    while True:
        out.append(cap)
        if cap >= need:
            return out
        cap *= 2


def decode_ratio(args: ModelArgs) -> int:
    """The smallest compression ratio of the main layers (0 without compressed layers): its
    layers' capacities are the ones the others' follow."""
    return min((r for r in args.compress_ratios[:args.n_layers] if r), default=0)


def decode_capacities(args: ModelArgs, max_seq_len: int) -> list[int]:
    """The compressed-cache capacities a conversation's decode steps pass through up to position
    `max_seq_len`: those of the layers of `decode_ratio` (none without compressed layers)."""
    ratio = decode_ratio(args)
    return capacity_buckets(max_seq_len, ratio) if ratio else []

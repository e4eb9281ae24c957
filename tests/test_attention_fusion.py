"""Native attention runs a CSA layer's two readers of c (wq_b, the indexer's wq_b) as one FP8 GEMV
over stacked rows; its halves must be the two projections, and exact numerics keeps them apart."""

import torch

from engine.attention import Attention
from engine.numerics import Numerics
from engine.weights import open_official
from kernels import reference as ref


def _attention(ckpt, numerics: Numerics, ratio: int):
    files = open_official(ckpt)
    layer = next(i for i in range(files.args.n_layers) if files.args.ratio(i) == ratio)
    return files, f"layers.{layer}.attn", Attention(files.get, f"layers.{layer}.attn", files.args, layer, numerics)


def test_csa_layer_projects_both_queries_in_one_native_gemv(tiny_ckpt):
    files, prefix, attn = _attention(tiny_ckpt, Numerics.named("native"), ratio=4)
    args = files.args
    assert attn.index_wq_b is None and attn.q_rows == args.n_heads * args.head_dim
    assert attn.wq_b.out_features == attn.q_rows + args.index_n_heads * args.index_head_dim

    torch.manual_seed(0)
    x = torch.randn(3, args.dim).to(torch.bfloat16)
    rot = attn.rope.table(torch.arange(5, 8))
    with torch.inference_mode():
        iq, q, _ = attn._project(x, rot)
    # the same c, each projection by itself from its on-disk weight
    qa = ref.fp8_gemm(x, files.get(f"{prefix}.wq_a.weight"), files.get(f"{prefix}.wq_a.scale"))
    c = attn.numerics.norm_quantized(qa, attn.q_norm, args.norm_eps)
    want_iq = ref.fp8_gemm_quantized(c.q, c.s, files.get(f"{prefix}.indexer.wq_b.weight"),
                                     files.get(f"{prefix}.indexer.wq_b.scale"))
    want_q = ref.fp8_gemm_quantized(c.q, c.s, files.get(f"{prefix}.wq_b.weight"), files.get(f"{prefix}.wq_b.scale"))
    want_q = attn.rope.normed(want_q.view(3, args.n_heads, args.head_dim), None, args.norm_eps, rot)
    assert iq.shape == (3, args.index_n_heads * args.index_head_dim)
    torch.testing.assert_close(iq, want_iq, rtol=0, atol=0)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)


def test_exact_numerics_and_other_layers_keep_their_own_projections(tiny_ckpt):
    _, _, exact = _attention(tiny_ckpt, Numerics.named("exact"), ratio=4)
    assert exact.index_wq_b is not None and exact.wq_b.out_features == exact.q_rows
    for ratio in (0, 128):  # no indexer: no indexer queries
        _, _, attn = _attention(tiny_ckpt, Numerics.named("native"), ratio=ratio)
        assert attn.indexer is None and attn.wq_b.out_features == attn.q_rows
        x = torch.randn(2, attn.args.dim).to(torch.bfloat16)
        with torch.inference_mode():
            iq, q, _ = attn._project(x, attn.rope.table(torch.arange(2)))
        assert iq is None and q.shape == (2, attn.n_heads, attn.head_dim)

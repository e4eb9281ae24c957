"""Manifold-constrained hyper-connections (spec §C.3): 4 residual streams mixed around each
sub-block (HCPre / HCPost) and collapsed once at the end (HCHead). All mixing math is fp32.

The math lives in kernels/reference.py (HCPre, HCPost) and `hc_head` here; the classes hold the
parameters, and the numerics mode's ops compute (the backend's in native, the reference's in exact).
"""

from __future__ import annotations

import torch

from engine.config import ModelArgs
from engine.numerics import Numerics
from kernels import reference as ref


# A sub-block's mHC pre: (block input x [S, D], post [S, n], comb_logits [S, n, n]).
MixedIn = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def spread_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[3] (pre, post, comb) -> [2n + n²]: each mix column's scale."""
    return torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))


def hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            eps: float, norm=ref.rms_norm) -> torch.Tensor:
    """HCHead: collapse the streams with sigmoid weights (no post, no Sinkhorn); `norm` is an
    RMSNorm with the reference's signature (the numerics mode's)."""
    sf = streams.float()
    mixes = ref.matmul(norm(sf.flatten(1), None, eps), fn.T)  # [S, n]
    pre = torch.sigmoid(mixes * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * sf).sum(dim=1).to(streams.dtype)


class HyperConnection:
    """HCPre/HCPost of one sub-block (attention or FFN) with its fn [24, n·D], scale [3], base [24].

    The math is `reference.hc_pre` / `reference.hc_post`; native runs the backend's (on CUDA a
    handful of fused launches instead of ~15 per call), exact the reference. The residual mix's
    Sinkhorn projection runs in `post`, where its result is used: on CUDA the post kernel projects
    while the sub-block's last kernel still runs (`early`), off the step's chain of kernels."""

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs,
                 numerics: Numerics):
        self.fn, self.base = fn.float(), base.float()
        self.scale = spread_scale(scale.float(), args.hc_mult)  # [2n + n²]
        self.n, self.iters, self.hc_eps, self.eps = args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps
        self.numerics = numerics

    def pre(self, streams: torch.Tensor) -> MixedIn:
        """streams [S, n, D] -> (block input x [S, D], post [S, n], comb_logits [S, n, n])."""
        return self.numerics.hc_pre(streams, self.fn, self.scale, self.base, self.n, self.hc_eps, self.eps)

    def post(self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb_logits: torch.Tensor) -> torch.Tensor:
        """Block output out [S, D] mixed back into the streams [S, n, D] -> new streams. `pre`
        made post and comb_logits, and the sub-block's kernels ran since: `early` holds."""
        return self.numerics.hc_post(out, streams, post, comb_logits, self.iters, self.hc_eps, early=True)

    def post_pre(self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor,
                 following: HyperConnection) -> tuple[torch.Tensor, MixedIn]:
        """`post`, then `following.pre` of the new streams, as one op (on CUDA one launch fewer on
        the decode step's chain) -> (new streams, following's (x, post, comb_logits))."""
        new, x, post2, comb2 = self.numerics.hc_post_pre(out, streams, post, comb_logits, self.iters, self.hc_eps,
                                                         following.fn, following.scale, following.base,
                                                         following.eps, early=True)
        return new, (x, post2, comb2)

    def moe_post_pre(self, routed: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor | None,
                     streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor,
                     following: HyperConnection) -> tuple[torch.Tensor, MixedIn]:
        """`post_pre` of a MoE layer's output given as its parts (engine/moe.py's `MoEParts`:
        routed, shared, rows): their combine is part of the op (on CUDA one launch fewer again)."""
        new, x, post2, comb2 = self.numerics.moe_post_pre(routed, shared, rows, streams, post, comb_logits,
                                                          self.iters, self.hc_eps, following.fn, following.scale,
                                                          following.base, following.eps, early=True)
        return new, (x, post2, comb2)


class HyperHead:
    """HCHead parameters: fn [n, n·D], scale [1], base [n]; native normalises through the backend
    (one launch on CUDA instead of ~7)."""

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs,
                 numerics: Numerics):
        self.fn, self.scale, self.base = fn.float(), scale.float(), base.float()
        self.consts = (args.hc_eps, args.norm_eps)
        self.norm = numerics.rms_norm

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head(streams, self.fn, self.scale, self.base, *self.consts, norm=self.norm)

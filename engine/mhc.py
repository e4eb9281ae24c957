"""Manifold-constrained hyper-connections (spec §C.3): 4 residual streams mixed around each
sub-block (HCPre / HCPost) and collapsed once at the end (HCHead). All mixing math is fp32.

The math lives in pure functions; the classes only hold the parameters.
"""

from __future__ import annotations

import torch

from engine.config import ModelArgs
from engine.numerics import Numerics
from kernels import reference as ref


def _mixes(flat: torch.Tensor, fn: torch.Tensor, eps: float, rms_norm=ref.rms_norm) -> torch.Tensor:
    """Unweighted RMS-normalised flat streams [S, n·D] fp32 times fn -> [S, fn rows] fp32."""
    return rms_norm(flat, None, eps) @ fn.T


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
           iters: int, hc_eps: float, eps: float, sinkhorn=ref.sinkhorn, rms_norm=ref.rms_norm
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [S, n, D] -> (block input x [S, D], post [S, n], comb [S, n, n]) (§C.3 HCPre).

    `scale` is [3] (pre, post, comb) or already spread over the 2n + n² mix columns."""
    sf = streams.float()
    m = _mixes(sf.flatten(1), fn, eps, rms_norm)  # [S, 2n + n²], stream 0 first
    if scale.numel() == 3:
        scale = spread_scale(scale, n)
    z = m * scale + base  # the same per-column products and sums as three separate slices
    gates = torch.sigmoid(z[:, :2 * n])  # pre and post columns in one launch
    pre = gates[:, :n] + hc_eps
    post = 2 * gates[:, n:]
    comb = sinkhorn(z[:, 2 * n:].view(-1, n, n), iters, hc_eps)  # row-major n×n
    x = (pre.unsqueeze(-1) * sf).sum(dim=1)
    return x.to(streams.dtype), post, comb


def spread_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[3] (pre, post, comb) -> [2n + n²]: each mix column's scale."""
    return torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream k = post_k · out + Σ_j comb[j, k] · stream_j (j = old streams), fp32 math."""
    mixed = torch.einsum("sjk,sjd->skd", comb, streams.float())
    # bf16 `out` widens exactly inside the product; the sum is rounded once into the stream dtype
    new = torch.empty(mixed.shape, dtype=streams.dtype, device=streams.device)
    return torch.add(post.unsqueeze(-1) * out.unsqueeze(1), mixed, out=new)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            eps: float) -> torch.Tensor:
    """HCHead: collapse the streams with sigmoid weights (no post, no Sinkhorn)."""
    sf = streams.float()
    pre = torch.sigmoid(_mixes(sf.flatten(1), fn, eps) * scale + base) + hc_eps  # [S, n]
    return (pre.unsqueeze(-1) * sf).sum(dim=1).to(streams.dtype)


class HyperConnection:
    """HCPre/HCPost of one sub-block (attention or FFN) with its fn [24, n·D], scale [3], base [24]."""

    post = staticmethod(hc_post)

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs,
                 numerics: Numerics):
        self.fn, self.base = fn.float(), base.float()
        self.scale = spread_scale(scale.float(), args.hc_mult)  # [2n + n²]
        self.consts = (args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)
        # Native runs the backend's fused Sinkhorn (one launch instead of ~120) and RMSNorm; exact
        # the reference.
        self.sinkhorn = numerics.backend.sinkhorn if numerics.native else ref.sinkhorn
        self.rms_norm = numerics.rms_norm

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_pre(streams, self.fn, self.scale, self.base, *self.consts, self.sinkhorn, self.rms_norm)


class HyperHead:
    """HCHead parameters: fn [n, n·D], scale [1], base [n]."""

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs):
        self.fn, self.scale, self.base = fn.float(), scale.float(), base.float()
        self.consts = (args.hc_eps, args.norm_eps)

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head(streams, self.fn, self.scale, self.base, *self.consts)

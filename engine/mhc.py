"""Manifold-constrained hyper-connections (spec §C.3): 4 residual streams mixed around each
sub-block (HCPre / HCPost) and collapsed once at the end (HCHead). All mixing math is fp32."""

from __future__ import annotations

import torch

from engine.config import ModelArgs
from kernels import reference as ref


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS-normalised flat streams times fn: [S, n, D] -> [S, fn rows] fp32."""
    flat = streams.flatten(1).float()  # [S, n·D], stream 0 first
    return ref.rms_norm(flat, None, eps) @ fn.T


class HyperConnection:
    """HCPre/HCPost of one sub-block (attention or FFN) with its fn [24, n·D], scale [3], base [24]."""

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs):
        self.fn, self.scale, self.base = fn.float(), scale.float(), base.float()
        self.n, self.iters, self.hc_eps, self.eps = args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [S, n, D] -> (block input x [S, D], post [S, n], comb [S, n, n]) (§C.3 HCPre)."""
        n = self.n
        m = _mixes(streams, self.fn, self.eps)
        pre = torch.sigmoid(m[:, :n] * self.scale[0] + self.base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(m[:, n:2 * n] * self.scale[1] + self.base[n:2 * n])
        comb_logits = (m[:, 2 * n:] * self.scale[2] + self.base[2 * n:]).view(-1, n, n)  # row-major n×n
        comb = ref.sinkhorn(comb_logits, self.iters, self.hc_eps)
        x = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
        return x.to(streams.dtype), post, comb

    @staticmethod
    def post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New stream k = post_k · out + Σ_j comb[j, k] · stream_j (j = old streams), fp32 math."""
        mixed = torch.einsum("sjk,sjd->skd", comb, streams.float())
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


class HyperHead:
    """HCHead: collapse the streams with sigmoid weights (no post, no Sinkhorn)."""

    def __init__(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, args: ModelArgs):
        self.fn, self.scale, self.base = fn.float(), scale.float(), base.float()
        self.hc_eps, self.eps = args.hc_eps, args.norm_eps

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        m = _mixes(streams, self.fn, self.eps)
        pre = torch.sigmoid(m * self.scale + self.base) + self.hc_eps  # [S, n]
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)

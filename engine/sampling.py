"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.

Everything stays on the logits' device: the result is a 0-d int64 tensor, so on a GPU the only
host transfer per token is the caller's one `.item()` of the chosen id. Sampling uses the
Gumbel-max form of the official demo (§F.3): argmax of probs / Exp(1) noise, which draws from
the (filtered) softmax without a cumulative-sum search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Sampling parameters out of range; the message names the parameter and its range."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-turn generation settings. temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    seed: int | None = None  # None: a fresh random seed per turn
    thinking: bool = False  # thinking mode (§F.2): the answer starts with reasoning

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100] (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise SamplingError(f"seed must be a 64-bit integer (-2^63 .. 2^64 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one that fp32 rounds to 0 (up to 2^-150): dividing by it would make NaNs."""
        return self.temperature <= 2.0 ** -150


class Sampler:
    """Draws tokens for one turn with its own seeded generator on `device`."""

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=torch.device(device))
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self._before: torch.Tensor | None = None  # the generator's state before the last draw

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] or [1, V] -> the chosen id, a 0-d int64 tensor on the logits' device."""
        if not self.params.greedy:  # the host's copy of the generator's seed and offset: no device sync
            self._before = self.generator.get_state()
        return sample(logits.reshape(-1), self.params, self.generator)

    def undo(self) -> None:
        """Forget the last draw: the generator as it was before it, so that drawing again (from
        logits that replace the ones it drew from) makes the draw it would have made."""
        if self._before is not None:
            self.generator.set_state(self._before)
            self._before = None


def checked(chosen: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The chosen id, or -1 when `logits` has a non-finite value: one 0-d tensor, so that the one
    copy of a token to the host also says whether the model's output was sound."""
    return torch.where(torch.isfinite(logits).all(), chosen, -1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] fp32 with everything outside top-k / the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p;
    the most likely token is always kept.
    """
    out = logits
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked above each token
        drop_sorted = before >= top_p
        drop_sorted[0] = False  # the most likely token, also where top_p rounds to 0 in fp32 (1e-300)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
           ) -> torch.Tensor:
    """logits [V] -> chosen id (0-d int64 tensor, same device). No host synchronisation."""
    logits = logits.float()
    if params.greedy:
        return torch.argmax(logits)
    # shifted so that the largest is 0 before dividing: a tiny temperature (1e-38) then sends the
    # others to -inf (a one-hot softmax) instead of every logit to ±inf (a NaN softmax)
    scaled = filter_logits((logits - logits.max()) / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise)

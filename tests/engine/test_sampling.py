"""Sampling: greedy, temperature, top-k, top-p, seeds, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import Sampler, SamplingError, SamplingParams, checked, filter_logits, sample

LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.5, -1.0, 2.0])  # order by value: 1, 3, 5, 0, 2, 4


def draws(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    sampler = Sampler(params)
    return [int(sampler(logits)) for _ in range(n)]


def test_greedy_is_argmax_and_stays_on_device_as_a_tensor():
    out = sample(LOGITS, SamplingParams(temperature=0.0))
    assert isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype == torch.int64
    assert int(out) == 1
    assert Sampler(SamplingParams(temperature=0.0))(LOGITS.view(1, -1)).item() == 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    assert set(draws(SamplingParams(temperature=1.5, top_k=1, seed=0), 50)) == {1}
    assert set(draws(SamplingParams(temperature=1.5, top_p=0.01, seed=0), 50)) == {1}


def test_top_k_restricts_the_support():
    got = draws(SamplingParams(temperature=2.0, top_k=3, seed=1), 600)
    assert set(got) == {1, 3, 5}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS, -1)  # sorted: 1 (.39), 3 (.24), 5 (.14), 0 (.05) ...
    p13 = float(probs[1] + probs[3])
    f = filter_logits(LOGITS, 0, p13 - 1e-3)  # needs token 3 to reach the mass
    assert torch.isfinite(f).nonzero().flatten().tolist() == [1, 3]
    f = filter_logits(LOGITS, 0, p13 + 1e-3)  # now token 5 is needed too
    assert torch.isfinite(f).nonzero().flatten().tolist() == [1, 3, 5]
    got = draws(SamplingParams(temperature=1.0, top_p=p13 - 1e-3, seed=2), 400)
    assert set(got) == {1, 3}


def test_temperature_one_follows_the_softmax():
    n = 4000
    got = torch.tensor(draws(SamplingParams(temperature=1.0, seed=3), n))
    freq = torch.bincount(got, minlength=6).float() / n
    expected = torch.softmax(LOGITS, -1)
    sigma = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() < 5 * sigma + 1e-3), (freq, expected)


def test_low_temperature_sharpens():
    hot = draws(SamplingParams(temperature=0.05, seed=4), 200)
    assert hot.count(1) >= 195


def test_seed_reproduces_and_none_varies():
    p = SamplingParams(temperature=1.0, seed=123)
    assert draws(p, 64) == draws(p, 64)
    assert draws(SamplingParams(temperature=1.0, seed=124), 64) != draws(p, 64)
    unseeded = SamplingParams(temperature=1.0)
    assert len({tuple(draws(unseeded, 32)) for _ in range(3)}) > 1


def test_big_vocab_sample_is_in_range():
    logits = torch.randn(129280, generator=torch.Generator().manual_seed(0))
    tok = int(sample(logits, SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=0),
                     torch.Generator().manual_seed(0)))
    assert tok in torch.topk(logits, 50).indices.tolist()


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": math.nan}, "temperature"),
])
def test_bad_parameters_name_the_parameter(kwargs, word):
    with pytest.raises(SamplingError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.gpu
def test_cuda_sampling_returns_a_device_tensor():
    logits = LOGITS.cuda()
    out = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0), "cuda")(logits)
    assert out.device.type == "cuda" and int(out) in (1, 3, 5)


def _undone_draws(device: str) -> tuple[list[int], list[int]]:
    """40 seeded draws from LOGITS, each first preceded by a draw from other logits that is
    undone (a wrong guess's token drawn again, engine/turn.py), and the same 40 draws made plainly."""
    params = SamplingParams(temperature=2.0, seed=7)
    logits, wrong = LOGITS.to(device), LOGITS.flip(0).to(device)
    undone, plain = Sampler(params, device), Sampler(params, device)
    got = []
    for _ in range(40):
        undone(wrong)
        undone.undo()
        got.append(int(undone(logits)))
    return got, [int(plain(logits)) for _ in range(40)]


def test_an_undone_draw_leaves_the_draws_after_it_as_they_were():
    got, want = _undone_draws("cpu")
    assert got == want and len(set(want)) > 2  # the draws vary: the generator's state matters


@pytest.mark.gpu
def test_an_undone_draw_on_the_gpu_leaves_the_draws_after_it_as_they_were():
    got, want = _undone_draws("cuda")
    assert got == want and len(set(want)) > 2


def test_undo_without_a_draw_or_when_greedy_changes_nothing():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    sampler.undo()  # nothing drawn yet
    assert [int(sampler(LOGITS)) for _ in range(10)] == draws(SamplingParams(temperature=1.0, seed=3), 10)
    greedy = Sampler(SamplingParams(temperature=0.0))
    greedy(LOGITS)
    greedy.undo()
    assert int(greedy(LOGITS)) == 1


def test_checked_gives_the_id_or_minus_one_when_the_logits_are_not_finite():
    logits = torch.tensor([0.5, 2.0, -1.0])
    chosen = sample(logits, SamplingParams(temperature=0.0))
    assert checked(chosen, logits).item() == 1
    for bad in (float("nan"), float("inf")):
        assert checked(chosen, torch.tensor([0.5, bad, -1.0])).item() == -1


def test_warm_sampling_runs_the_decode_loops_per_token_work_once_per_mode():
    from engine.warmup import warm_sampling

    class Reads:
        def __init__(self):
            self.values = []

        def read(self, token):
            self.values.append(token)
            return lambda: int(token)

    runtime = Reads()
    warm_sampling(runtime, 50, torch.device("cpu"))
    assert len(runtime.values) == 2  # greedy, then filtered sampling
    assert all(t.dim() == 0 and t.dtype == torch.int64 and 0 <= int(t) < 50 for t in runtime.values)


@pytest.mark.parametrize("kwargs", [{"temperature": 1e-38}, {"temperature": 1e-30, "top_k": 5},
                                    {"temperature": 0.7, "top_p": 1e-300}, {"temperature": 1e-38, "top_p": 1e-45},
                                    {"temperature": 1e-300}, {"temperature": 2.0 ** -150},
                                    {"temperature": 2.0 ** -149}, {"temperature": 5e-324, "top_k": 3}])
def test_the_smallest_accepted_temperature_and_top_p_choose_the_most_likely_token(kwargs):
    logits = torch.randn(129280, generator=torch.Generator().manual_seed(1)) * 4
    for seed in range(4):
        assert int(sample(logits, SamplingParams(**kwargs), torch.Generator().manual_seed(seed))) == int(logits.argmax())


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**64])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(SamplingError, match="seed must be a 64-bit integer"):
        SamplingParams(seed=seed)
    Sampler(SamplingParams(seed=2**64 - 1))  # the largest accepted seed works
    Sampler(SamplingParams(seed=-2**63))

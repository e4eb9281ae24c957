"""engine/lanes.py off CUDA: the side lane runs in place, in program order (the GPU tests check
that a forked lane changes no bit of a step: tests/engine/test_decode_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.lanes import Lanes


def test_off_cuda_the_side_lane_runs_in_place_in_order():
    for lanes in (Lanes(None), Lanes(torch.device("cpu"))):
        assert lanes.stream is None and not lanes.forks
        x = torch.zeros(3)
        with lanes.side():
            x += 1
            assert x.tolist() == [1, 1, 1]  # ran at once, on the one stream
        x *= 2
        lanes.join()
        assert x.tolist() == [2, 2, 2]


def test_an_error_inside_the_side_lane_propagates():
    lanes = Lanes(None)
    try:
        with lanes.side():
            raise KeyError("boom")
    except KeyError as err:
        assert err.args == ("boom",)
    else:
        raise AssertionError("the error was swallowed")



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_a_graph_capture_the_side_lane_forks_and_joins_and_a_bare_join_waits_for_nothing():
    """Captured: the side block becomes a branch of the graph, joined before its result is read;
    a join with nothing forked in the capture must not wait for the side stream's earlier work
    (outside the capture: that would invalidate it)."""
    dev = torch.device("cuda")
    lanes = Lanes(dev)
    assert lanes.forks
    x = torch.zeros(4, device=dev)
    with lanes.side():  # earlier work on the side stream, outside any capture
        x += 1
    lanes.join()
    capture = torch.cuda.Stream(dev)
    capture.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        lanes.join()  # nothing forked yet
        x.mul_(2)
        with lanes.side():
            x.add_(3)
        lanes.join()
        y = x * 10
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4  # captured, not run
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [5.0] * 4 and y.tolist() == [50.0] * 4


def test_off_cuda_warm_work_does_not_run_and_settle_joins_the_side_lane():
    """Warm work is a hint (L2 prefetches): off CUDA there is no cache to warm, so it is not run;
    `settle` still joins what the side lane holds."""
    lanes = Lanes(None)
    ran = []
    lanes.warm(ran.append)
    assert ran == [] and lanes.warm_stream is None and lanes.warm_bytes == 0
    x = torch.zeros(2)
    with lanes.side():
        x += 1
    lanes.settle()
    assert x.tolist() == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_a_graph_capture_warm_work_forks_and_settle_joins_it():
    """Captured: warm work is a branch that only `settle` joins (a capture that ends unjoined
    fails); its budget is a share of the device's L2; `Lanes(dev, warm=False)` queues none."""
    dev = torch.device("cuda")
    lanes = Lanes(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    assert 0 < lanes.warm_bytes <= l2 and lanes.warm_bytes % 16 == 0
    w = torch.randn(1 << 20, device=dev)
    budgets = []
    capture = torch.cuda.Stream(dev)
    capture.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        y = w * 2
        lanes.warm(lambda nbytes: (budgets.append(nbytes), w.add_(0)))  # any kernel: it must be joined
        z = y + 1
        lanes.settle()
    graph.replay()
    torch.cuda.synchronize()
    assert budgets == [lanes.warm_bytes]
    assert torch.equal(z, w * 2 + 1)
    off = Lanes(dev, warm=False)
    off.warm(budgets.append)
    assert off.warm_stream is None and budgets == [lanes.warm_bytes]

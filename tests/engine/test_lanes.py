"""engine/lanes.py off CUDA: the side lanes run in place, in program order (the GPU tests check
that forked lanes change no bit of a step: tests/engine/test_decode_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.lanes import SIDE_LANES, Lanes


def test_off_cuda_the_side_lanes_run_in_place_in_order():
    for lanes in (Lanes(None), Lanes(torch.device("cpu"))):
        assert lanes.streams == [] and not lanes.forks
        x = torch.zeros(3)
        with lanes.side():
            x += 1
            assert x.tolist() == [1, 1, 1]  # ran at once, on the one stream
        with lanes.side(SIDE_LANES - 1):
            x *= 3
        x *= 2
        lanes.join()
        assert x.tolist() == [6, 6, 6]


def test_a_side_lane_that_does_not_exist_is_refused():
    for lane in (-1, SIDE_LANES):
        with pytest.raises(ValueError, match=f"side lane {lane} does not exist"):
            with Lanes(None).side(lane):
                pass


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
    z = torch.zeros(4, device=dev)
    with torch.cuda.graph(graph, stream=capture):
        lanes.join()  # nothing forked yet
        x.mul_(2)
        with lanes.side():
            x.add_(3)
        with lanes.side(1):  # a second branch beside the first
            z.add_(7)
        lanes.join()
        y = x * 10 + z
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4  # captured, not run
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [5.0] * 4 and y.tolist() == [57.0] * 4

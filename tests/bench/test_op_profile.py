"""bench/op_profile.py's timeline of a replayed step, on hand-made kernel spans (CPU)."""

from bench.op_profile import Span, last_call, occupancy, stream_id, timeline


def test_occupancy_counts_idle_single_and_overlapping_time():
    spans = [Span("a", 7, 0.0, 10.0), Span("b", 9, 4.0, 6.0), Span("c", 7, 12.0, 15.0)]
    at = occupancy(spans)
    assert at[0] == 2.0  # 10..12
    assert at[1] == 4.0 + 4.0 + 3.0  # 0..4, 6..10, 12..15
    assert at[2] == 2.0  # 4..6


def test_stream_ids_from_either_trace_spelling():
    assert stream_id(7) == 7
    assert stream_id("stream 13") == 13
    assert stream_id("") == -1


def test_timeline_of_the_last_call_shows_the_middle_layer_with_gaps():
    # two calls of a 2-layer step, 3 kernels a layer; the second call starts at 100 us
    def call(t0: float) -> list[Span]:
        out, t = [], t0
        for layer in range(2):
            for k, (name, stream) in enumerate((("norm", 7), ("gemv", 7), ("side", 9))):
                out.append(Span(f"{name}{layer}", stream, t, t + 2.0 + k))
                t += 3.0 + k  # 1 us gap after each
        return out

    lines = timeline(call(0.0) + call(100.0), calls=2, layers=2)
    head = lines[0]
    assert "6 kernels" in head
    assert "no kernel 5.0 us" in head  # the 1-us gaps between the second call's 6 kernels
    kinds = lines.index("  kernel kinds by time in the call (count, sum us, median us):")
    assert [line.split()[-1] for line in lines[kinds + 1:kinds + 3]] == ["side0", "side1"]  # 4 us each: most
    order = next(i for i, line in enumerate(lines) if "about layer 1" in line)
    shown = lines[order + 1:]
    assert [line.split()[-1] for line in shown] == ["norm1", "gemv1", "side1"]
    # norm1 on stream 7 starts 1 us after side0 ended but 6 us after gemv0 (its stream's last) ended
    first = shown[0].split()
    assert first[0] == "7" and float(first[1]) == 0.0 and float(first[2]) == 2.0 and float(first[3]) == 6.0


def test_timeline_of_nothing_says_so():
    assert "no kernels" in timeline([], calls=1, layers=43)[0]


def test_the_last_call_starts_after_the_longest_idle_stretches_whatever_its_kernel_count():
    first = [Span("a", 7, 0.0, 2.0), Span("b", 7, 2.5, 4.0)]  # 0.5 us inside a call
    second = [Span("c", 7, 50.0, 51.0)]  # 46 us of host work before it
    third = [Span("d", 7, 90.0, 91.0), Span("e", 9, 90.5, 92.0), Span("f", 7, 93.0, 94.0)]
    spans = first + second + third
    assert last_call(spans, 3) == third
    assert last_call(spans, 1) == spans


def test_timeline_can_show_several_layers_from_the_middle_one():
    # one call of a 4-layer step, 2 kernels a layer: layers 2 and 3 shown
    spans = [Span(f"k{layer}_{j}", 7, 10.0 * (2 * layer + j), 10.0 * (2 * layer + j) + 5.0)
             for layer in range(4) for j in range(2)]
    lines = timeline(spans, calls=1, layers=4, shown=2)
    order = next(i for i, line in enumerate(lines) if "about layers 2..3" in line)
    assert [line.split()[-1] for line in lines[order + 1:]] == ["k2_0", "k2_1", "k3_0", "k3_1"]
    lines = timeline(spans, calls=1, layers=4, shown=9)  # no further than the last layer
    order = next(i for i, line in enumerate(lines) if "about layers 2..3" in line)
    assert len(lines) - order - 1 == 4

"""Live tensor bytes on the CPU and the measure() helper."""

from __future__ import annotations

import pytest
import torch

from tightfit.memory import LiveTensorBytes, allocated_peak, measure, tensor_bytes


def test_tracker_counts_live_bytes_and_keeps_the_peak():
    with LiveTensorBytes() as tracker:
        a = torch.ones(1 << 20)  # 4 MiB
        b = a * 2  # 4 MiB more
        peak_with_both = tracker.current
        del a, b
        torch.zeros(1)  # any op samples again
    assert peak_with_both >= 8 << 20
    assert tracker.peak >= 8 << 20
    assert tracker.current < 1 << 20


def test_views_count_once():
    with LiveTensorBytes() as tracker:
        a = torch.ones(1 << 20)
        views = [a[i:] for i in range(10)]
    assert tracker.peak < 5 << 20
    del views


def test_tensor_bytes_counts_tied_weights_once():
    shared = torch.nn.Parameter(torch.ones(100))
    assert tensor_bytes([shared, shared, shared[:10]]) == 400


def test_measure_cpu_reports_time_peak_and_rss():
    result = measure(lambda: torch.ones(1 << 22).sum(), "cpu", repeat=3, baseline_bytes=123)
    assert len(result.seconds) == 3 and result.median_seconds > 0
    assert result.peak_bytes >= 123 + (16 << 20)
    assert result.peak_rss_bytes > 16 << 20


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"repeat": 0}, ValueError, "repeat must be an int >= 1"),
        ({"warmup": -1}, ValueError, "warmup must be an int >= 0"),
        ({"baseline_bytes": 1.5}, ValueError, "baseline_bytes must be an int"),
    ],
)
def test_measure_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        measure(lambda: None, "cpu", **kwargs)


def test_measure_rejects_non_callable_and_bad_device():
    with pytest.raises(TypeError, match="fn must be callable"):
        measure(42, "cpu")
    with pytest.raises(ValueError, match="device_type must be"):
        LiveTensorBytes("")


@torch.library.custom_op("tightfit_test::sum_through_scratch", mutates_args=())
def _sum_through_scratch(x: torch.Tensor) -> torch.Tensor:
    """One op that allocates a 16 MiB temporary inside its kernel and frees it before returning."""
    return (x.expand(1 << 22).contiguous() * 1.0).sum()


def test_allocated_peak_sees_scratch_inside_one_op_that_the_live_count_misses():
    x = torch.ones(1)
    with LiveTensorBytes() as tracker:
        _sum_through_scratch(x)
    scratch = 2 * (16 << 20)  # the contiguous copy and the product
    assert tracker.peak < 1 << 10  # only the scalar result is seen between ops
    assert allocated_peak(lambda: _sum_through_scratch(x)) >= scratch
    measured = measure(lambda: _sum_through_scratch(x), "cpu", repeat=1, baseline_bytes=100)
    assert measured.peak_bytes < 100 + (1 << 10)
    assert measured.allocated_peak_bytes >= 100 + scratch


def test_allocated_peak_rejects_a_non_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        allocated_peak(3)


def test_tracker_ignores_pre_existing_storages_returned_by_views_and_in_place_ops():
    weight = torch.ones(1 << 20)  # 4 MiB, exists before tracking
    activations = torch.ones(2, 1 << 20)  # 8 MiB, likewise
    with LiveTensorBytes() as tracker:
        weight.t()
        weight.add_(0)
        torch.nn.functional.linear(activations, weight.view(1, -1))  # transposes weight inside
    assert tracker.peak < 1 << 10  # only the 2x1 result is new


def test_tensor_bytes_tells_meta_tensors_apart():
    a = torch.empty(100, device="meta")
    b = torch.empty(100, device="meta")
    assert tensor_bytes([a, b]) == 800


def test_median_of_an_even_count():
    from tightfit.memory import Measurement

    assert Measurement("cpu", [1.0, 2.0, 3.0, 10.0], 0, 0, None, "").median_seconds == 2.5


def test_measure_rejects_unknown_device():
    with pytest.raises(ValueError, match="backend 'bogus' is not known"):
        measure(lambda: None, "bogus")


def test_existing_tensors_count_until_freed():
    weight = torch.ones(1024)
    holder = [weight]
    with LiveTensorBytes(existing=holder) as tracker:
        assert tracker.current == 4096
        holder[0] = holder[0].to(torch.float16)  # a hook replacing a weight: the old storage goes
        del weight
        torch.zeros(1)
    assert (
        tracker.current == 2048 + 4 and tracker.peak == 4096 + 2048
    )  # old and new side by side, then the old one freed
    with pytest.raises(TypeError, match="existing must hold tensors"):
        LiveTensorBytes(existing=[1])


def test_tracker_keeps_a_timeline_only_when_asked():
    from tightfit.memory import mark

    with LiveTensorBytes() as silent:
        torch.ones(1 << 10) * 2
        mark("ignored")
    assert silent.samples == [] and silent.marks == []
    with LiveTensorBytes(record=True) as tracker:
        a = torch.ones(1 << 20)  # 4 MiB
        mark("second half")
        b = a * 2
        del a, b
        torch.zeros(1)
    assert tracker.samples == [4 << 20, 8 << 20, 4]  # after each op: ones, mul (then both freed), zeros
    assert tracker.marks == [(1, "second half")]
    with pytest.raises(TypeError, match="record must be a bool, got str"):
        LiveTensorBytes(record="yes")


def test_measure_records_a_timeline_with_the_baseline():
    from tightfit.memory import MemoryTimeline, mark

    def work():
        mark("work")
        return torch.ones(1 << 20).sum()

    plain = measure(work, "cpu", repeat=1, baseline_bytes=100)
    assert plain.timeline is None
    recorded = measure(work, "cpu", repeat=1, baseline_bytes=100, timeline=True)
    timeline = recorded.timeline
    assert isinstance(timeline, MemoryTimeline) and timeline.device == "cpu"
    # ones, then its float32 sum while the ones are still alive
    assert (
        timeline.samples == (100, 100 + (4 << 20), 100 + (4 << 20) + 4) and timeline.peak_bytes == recorded.peak_bytes
    )
    assert timeline.marks == ((1, "work"),)
    with pytest.raises(TypeError, match="timeline must be a bool"):
        measure(work, "cpu", timeline=1)


def test_allocated_bytes_samples_the_reading_after_each_op():
    from tightfit.memory import AllocatedBytes, mark

    readings = iter(range(100, 1000, 100))
    with AllocatedBytes("cpu", read=lambda: next(readings)) as sampler:
        mark("start")
        torch.ones(3) + 1
    assert sampler.samples == [100, 200, 300] and sampler.marks == [(1, "start")]
    with pytest.raises(TypeError, match="read must be callable"):
        AllocatedBytes("cpu", read=5)


@pytest.mark.parametrize(
    "device, error, message",
    [
        ("bogus", ValueError, "device='bogus' is not a valid torch device"),
        (3, TypeError, "device must be torch.device or str, got int: 3"),
        (None, TypeError, "device must be torch.device or str, got NoneType"),
    ],
)
def test_allocated_bytes_checks_the_device(device, error, message):
    from tightfit.memory import AllocatedBytes

    with pytest.raises(error, match=message):
        AllocatedBytes(device, read=lambda: 0)


def test_mark_needs_a_str_label():
    from tightfit.memory import mark

    with pytest.raises(TypeError, match="label must be a str, got int: 3"):
        mark(3)
    with pytest.raises(TypeError, match="label must be a str, got NoneType"):
        mark(None)
    mark("prefill")  # nothing records: nothing happens


def test_measure_keeps_what_the_timed_calls_returned_and_only_those():
    from itertools import count

    counter = count()
    measured = measure(lambda: next(counter), "cpu", repeat=3, warmup=2, timeline=True, keep_results=True)
    assert measured.results == (2, 3, 4)  # not the warmups (0, 1) nor the tracked calls after (5, 6, ...)
    assert next(counter) > 5
    assert measure(lambda: 1, "cpu", repeat=2).results == ()
    with pytest.raises(TypeError, match="keep_results must be a bool, got int: 1"):
        measure(lambda: 1, "cpu", keep_results=1)

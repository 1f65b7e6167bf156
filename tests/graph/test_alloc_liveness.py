"""Lifetimes from fake-tensor storages: views, in-place results, multiple outputs, aliasing inputs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tightfit.graph.alloc import graph_timeline, plan_arenas, verify_arena
from tightfit.graph.alloc.liveness import check_order

F32 = 4


def traced(fn, *shapes):
    """``fn`` traced op by op (no functionalization) with fake inputs of ``shapes`` (float32)."""
    with FakeTensorMode():
        return make_fx(fn)(*(torch.empty(shape) for shape in shapes))


def buffers(timeline):
    return {buffer.name: buffer for buffer in timeline.buffers}


def steps(timeline):
    return {name: index for index, name in enumerate(timeline.steps)}


def checked(timeline, alignment=1):
    """The timeline, after its arenas pass the verifier and are no smaller than the lower bound."""
    for device, arena in plan_arenas(timeline, alignment).items():
        verify_arena(arena)
        assert arena.size >= timeline.lower_bound(device, alignment)
    return timeline


def test_a_view_shares_its_base_and_keeps_it_alive_until_the_views_last_use():
    def fn(x):
        a = x * 2  # 16 floats
        v = a[:2]  # a view of a
        b = x + 1
        c = b * 3
        return c + v.sum()

    timeline = checked(graph_timeline(traced(fn, (4, 4))))
    found, at = buffers(timeline), steps(timeline)
    assert "slice" not in found  # the view owns no storage
    assert found["mul"].nbytes == 16 * F32
    assert found["mul"].end == at["sum_1"]  # read through the view, after b and c exist
    assert timeline.lower_bound("cpu") == 3 * 16 * F32  # a, b, c alive when c is made


def test_an_in_place_result_shares_its_storage_and_extends_its_life():
    def fn(x):
        a = x * 2
        a.add_(1)  # in place: no new storage
        b = a.relu()
        return b

    timeline = checked(graph_timeline(traced(fn, (8,))))
    found, at = buffers(timeline), steps(timeline)
    assert set(found) == {"mul", "relu"}
    assert found["mul"].end == at["relu"]
    assert found["relu"].kind == "output" and found["relu"].end == len(timeline.steps) - 1


def test_each_output_of_a_multi_output_op_is_its_own_storage():
    def fn(x):
        out, mean, rstd = torch.native_layer_norm(x, [16], None, None, 1e-5)
        return out * 2

    timeline = checked(graph_timeline(traced(fn, (4, 16))))
    found, at = buffers(timeline), steps(timeline)
    norm = [name for name in found if name.startswith("native_layer_norm")]
    assert sorted(found[name].nbytes for name in norm) == [4 * F32, 4 * F32, 64 * F32]
    whole = next(name for name in norm if found[name].nbytes == 64 * F32)
    assert found[whole].end == at["mul"]
    for name in norm:
        if name != whole:  # mean and rstd: read by nobody after their getitem
            assert found[name].end < at["mul"]


def test_outputs_live_to_the_end_and_an_output_that_views_an_input_takes_no_arena():
    def fn(x, y):
        early = x * 2
        late = (x + y).sum()
        return early, y.t(), late

    timeline = checked(graph_timeline(traced(fn, (4, 4), (4, 4))))
    found = buffers(timeline)
    last = len(timeline.steps) - 1
    assert found["mul"].kind == "output" and found["mul"].end == last
    assert all(buffer.name != "t" for buffer in timeline.buffers)
    assert timeline.inputs == {"cpu": 2 * 16 * F32}


def test_inputs_that_alias_one_storage_are_counted_once_and_weights_apart():
    mode = FakeTensorMode()
    with mode:
        base = torch.empty(8, 8)
        first, second, weight = base[:4], base[4:], torch.empty(8, 8)
        graph_module = make_fx(lambda a, b, w: (a @ w) + (b @ w))(first, second, weight)
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    timeline = checked(graph_timeline(graph_module, weights=placeholders[2:]))
    assert timeline.inputs == {"cpu": 64 * F32}  # two views of one 8 x 8 storage
    assert timeline.weights == {"cpu": 64 * F32}


def test_an_explicit_order_is_checked():
    graph_module = traced(lambda x: (x * 2) + (x * 3), (4,))
    ops = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    reordered = [ops[1], ops[0], ops[2]]
    assert graph_timeline(graph_module, order=reordered).steps == ["mul_1", "mul", "add"]
    with pytest.raises(ValueError, match="before its input"):
        check_order(graph_module.graph, [ops[2], ops[0], ops[1]])
    with pytest.raises(ValueError, match="each of the graph's 3"):
        check_order(graph_module.graph, ops[:2])
    with pytest.raises(TypeError, match="sequence"):
        check_order(graph_module.graph, "mul")

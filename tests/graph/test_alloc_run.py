"""Arena execution (``memory="arena"``): outputs equal eager, forward and backward; the
measured peak equals the plan of ``runtime="arena"``; what has no out= kernel is reported."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import tightfit
from tightfit.graph import CompileOptions, compile_graph, compiler
from tightfit.graph.alloc import verify_arena
from tightfit.memory.compiled import compiled_peak
from zoo.graph import Attention


class Function(torch.nn.Module):
    """A plain function as a module, so that plan_memory can plan it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def branches(x):
    a, b, c = x * 2, x * 3, x * 4  # three temporaries alive at once, then reused
    return (a.relu() + b.sigmoid() + c.tanh()).sum(dim=0)


def views_and_in_place(x):
    y = x * 2
    z = y.t()  # a view of y: y lives as long as z is read
    z.add_(1)  # in place on the view
    w = torch.mm(z, x)
    return w.view(-1).softmax(dim=0), y.sum()


def multiple_outputs(x):
    values, indices = torch.max(x * 3, dim=1)
    return values * 2 + indices


def no_out_variant(x):
    q = x.view(1, 4, x.shape[0], -1)
    return torch.nn.functional.scaled_dot_product_attention(q * 2, q * 3, q).sum(dim=1)


GRAPHS = [branches, views_and_in_place, multiple_outputs, no_out_variant]


def _measure(compiled, *args, training=False):
    def step():
        if training:
            compiled(*args).backward()
        else:
            with torch.no_grad():
                compiled(*args)

    step()  # compile outside the measurement
    return compiled_peak(step)


@pytest.mark.parametrize("fn", GRAPHS, ids=lambda fn: fn.__name__)
def test_a_hand_made_graph_runs_in_its_arena_and_its_peak_is_the_plan(fn):
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    model = Function(fn)
    compiled = torch.compile(model, backend=compiler(memory="arena"))
    with torch.no_grad():
        expected, got = fn(x.clone()), compiled(x.clone())
    torch.testing.assert_close(got, expected)
    plan = tightfit.plan_memory(model, x, runtime="arena")
    plan.verify()
    assert plan.runtime == "arena" and plan.run_arenas["inference"]["cpu"] > 0
    assert _measure(compiled, x) == plan.devices["cpu"].live_peak_bytes


def test_results_are_views_of_one_buffer_at_the_planned_offsets():
    with FakeTensorMode():
        graph_module = make_fx(branches)(torch.empty(256, 256))
    program = compile_graph(graph_module, [], options=CompileOptions(memory="arena"), name="inference")
    layout = program.layout
    arena = layout.arenas["cpu"]
    verify_arena(arena)
    assert [step.how for step in program.steps] == ["arena"]
    # a, b, c and their relu/sigmoid/tanh alive together at most: the arena is far below their sum
    assert arena.size < sum(buffer.nbytes for buffer in arena.buffers)
    x = torch.randn(256, 256)
    torch.testing.assert_close(program([x.clone()]), branches(x))
    placed = {buffer.name for buffer in arena.buffers}
    assert {"mul", "mul_1", "mul_2", "sigmoid", "tanh"} <= placed
    reasons = {entry.name: entry.reason for entry in layout.outside}
    assert reasons == {"relu": "out= variant generated (computes, then copies) on cpu", "sum_1": "a graph output"}


def test_symbolic_shapes_run_with_the_allocator_and_say_so():
    """A recompile for a new input shape gives symbolic shapes, which an arena in bytes cannot hold."""
    compiled = torch.compile(Function(branches), backend=compiler(memory="arena"), dynamic=True)
    x = torch.randn(32, 16)
    with pytest.warns(tightfit.FallbackWarning, match="arena execution needs static shapes"), torch.no_grad():
        got = compiled(x)
    torch.testing.assert_close(got, branches(x))
    with tightfit.strict(), pytest.raises(Exception, match="static shapes.*strict mode forbids"), torch.no_grad():
        torch._dynamo.reset()
        compiled(x)


def test_ops_without_an_out_kernel_are_reported_with_their_bytes():
    x = torch.randn(64, 64)
    plan = tightfit.plan_memory(Function(no_out_variant), x, runtime="arena")
    reasons = {entry.op: entry.reason for entry in plan.outside}
    assert reasons["aten::_scaled_dot_product_flash_attention_for_cpu"] == "no out= variant"
    assert all(entry.nbytes > 0 for entry in plan.outside)
    text = str(plan)
    assert "execution arena of the inference graph: cpu" in text and "allocated outside the arena" in text
    data = plan.to_dict()
    assert data["run_arenas"]["inference"]["cpu"] == plan.run_arenas["inference"]["cpu"]
    assert {"graph", "tensor", "op", "device", "bytes", "reason"} <= set(data["outside"][0])


class Block(torch.nn.Module):
    """A small transformer block with a loss: attention, then a pre-norm MLP."""

    def __init__(self):
        super().__init__()
        self.attention = Attention(embed=64, heads=4)
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        h = x + self.attention(x)
        return (h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))).square().mean()


@pytest.mark.parametrize("training", [False, True])
def test_a_transformer_block_matches_eager_and_its_plan(training):
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 64, 64)
    expected = model(x)
    if training:
        expected.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=compiler(memory="arena"))
    got = compiled(x)
    torch.testing.assert_close(got, expected)
    if training:
        got.backward()
        for param, grad in zip(model.parameters(), grads):
            torch.testing.assert_close(param.grad, grad)
        model.zero_grad(set_to_none=True)
    plan = tightfit.plan_memory(model, x, training=training, runtime="arena")
    plan.verify()
    predicted = plan.devices["cpu"].live_peak_bytes
    measured = _measure(compiled, x, training=training)
    model.zero_grad(set_to_none=True)
    assert abs(measured - predicted) <= 0.001 * predicted, (measured, predicted)
    assert set(plan.run_arenas) == ({"forward", "backward"} if training else {"inference"})


def test_options_are_checked():
    with pytest.raises(ValueError, match="memory='pool' is not accepted; accepted: allocator, arena"):
        compiler(memory="pool")
    with pytest.raises(TypeError, match="memory must be str"):
        CompileOptions(memory=1)
    with pytest.raises(ValueError, match="execution='inductor' cannot"):
        compiler(memory="arena", execution="inductor")
    with pytest.raises(ValueError, match="accepted: backends, execution, memory"):
        CompileOptions.from_options({"arena": True})
    assert CompileOptions.from_options({"memory": "arena"}).memory == "arena"


def test_a_dfs_split_runs_as_usual_beside_arena_splits():
    torch.manual_seed(0)
    model = Attention(embed=64, heads=8, hints={"schedule": "dfs", "slices": 4, "slice_dim": 1})
    x = torch.randn(2, 128, 64)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend=compiler(memory="arena", execution="fx"))  # the slices as FX too
        torch.testing.assert_close(compiled(x), expected)
    plan = tightfit.plan_memory(model, x, runtime="arena")
    assert any(entry.reason == "in a DFS split" for entry in plan.outside)
    predicted = plan.devices["cpu"].live_peak_bytes
    measured = _measure(compiled, x)
    # the slices' workspace is planned as one slice body's own arena; the allocator differs by a little
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)

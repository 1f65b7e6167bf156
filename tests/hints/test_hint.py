"""tightfit.hint: validated where written, a no-op in eager mode, carried by tracing."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.backends import RUNTIME_HINTS
from tightfit.hints import HINT_ORDERS, HINTS, KNOWN_HINTS, HintSpec, is_vendor_key, keys_honored_by


def traced_hints(fn, *args):
    """The regions dynamo's graph carries for ``fn`` (no aot_autograd, no tightfit backend)."""
    found = []

    def backend(graph_module, example_inputs):
        found.extend(tightfit.hints_of(graph_module))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return found


@pytest.mark.parametrize(
    "hints",
    [
        {"schedule": "bfs"},
        {"schedule": "dfs", "slices": 8, "slice_dim": 1},
        {"slice_dim": "auto"},
        {"slice_dim": -1},
        {"device": "cpu"},
        {"device": "cuda:1"},
        {"device": torch.device("cpu")},
        {"stream": "side"},
        {"stream": 2},
        {"order": "as_written"},
        {"order": "any"},
        {"acme.tile": 128},
        {"acme.mode": ("a", 1, None)},
        {"acme.sub.key": True},
        {},
    ],
)
def test_valid_hints_are_accepted(hints):
    scope = tightfit.hint(**hints)
    expected = {key: str(value) if key == "device" else value for key, value in hints.items()}
    assert scope.hints == expected


@pytest.mark.parametrize(
    "hints, error, words",
    [
        ({"schedule": "depth"}, ValueError, "hint schedule='depth' is not accepted; accepted: bfs, dfs"),
        ({"schedule": 1}, TypeError, "hint schedule must be str"),
        ({"slices": 0}, ValueError, "slices=0"),
        ({"slices": 2.0}, TypeError, "slices must be int"),
        ({"slices": True}, TypeError, "slices must be int"),
        ({"slice_dim": "heads"}, ValueError, "slice_dim='heads'"),
        ({"slice_dim": 1.5}, TypeError, "slice_dim must be int or 'auto'"),
        ({"device": ""}, ValueError, "device=''"),
        ({"device": "cuda:x"}, ValueError, "not a backend name or device string"),
        ({"device": 0}, TypeError, "hint device must be str or device"),
        ({"stream": 1.5}, TypeError, "stream must be str or int"),
        ({"order": "sorted"}, ValueError, "accepted: any, as_written"),
        ({"tile": 4}, ValueError, "hint 'tile' is not known; known hints: schedule"),
        ({"tightfit.tile": 4}, ValueError, "'tightfit.tile' is not known"),
        ({"acme.": 4}, ValueError, "is not known"),
        ({"acme.tile": [1, 2]}, TypeError, "namespaced hint's value must be"),
        ({"acme.tile": torch.ones(1)}, TypeError, "namespaced hint's value must be"),
    ],
)
def test_invalid_hints_raise_where_written(hints, error, words):
    with pytest.raises(error, match=None) as raised:
        tightfit.hint(**hints)
    assert words in str(raised.value)


def test_invalid_hints_raise_the_same_error_inside_torch_compile():
    def fn(x):
        with tightfit.hint(schedule="dfs", slices=0):
            return x + 1

    with pytest.raises(ValueError, match="slices=0"):
        torch.compile(fn, backend="eager")(torch.ones(2))


def test_vendor_keys_are_namespaced():
    assert is_vendor_key("acme.tile") and is_vendor_key("acme.a.b")
    assert not is_vendor_key("tile") and not is_vendor_key(".tile") and not is_vendor_key("tightfit.x")
    assert not is_vendor_key("1acme.tile")
    assert set(KNOWN_HINTS) == {"schedule", "slices", "slice_dim", "device", "stream", "order"}


def test_one_table_says_what_each_key_is_and_who_honors_it():
    assert dict(KNOWN_HINTS) == {name: spec.doc for name, spec in HINTS.items()}
    assert keys_honored_by("schedules") == {"schedule", "slices", "slice_dim"}  # the DFS pass: its region keys
    assert keys_honored_by("partition") == {"schedule", "order"}
    assert keys_honored_by("assignment") == {"device"}
    assert RUNTIME_HINTS == keys_honored_by() == set(HINTS) - {"stream"}  # stream: no pass of tightfit's honors it
    with pytest.raises(ValueError, match="graph_pass='slicing' is not accepted; accepted: assignment, memory order"):
        keys_honored_by("slicing")
    with pytest.raises(ValueError, match="honored_by=\\('dfs',\\) names no pass"):
        HintSpec("tile", "an int", int, ("dfs",))


def test_the_old_name_of_the_order_hints_values_warns():
    with pytest.warns(DeprecationWarning, match="tightfit.hints.ORDERS is renamed HINT_ORDERS"):
        assert tightfit.hints.ORDERS == HINT_ORDERS == ("any", "as_written")


def test_eager_mode_hints_change_nothing():
    x = torch.randn(8, 8)
    with tightfit.hint(schedule="dfs", slices=4, device="cpu"):
        inside = (x @ x).softmax(-1)
    assert torch.equal(inside, (x @ x).softmax(-1))


def test_decorator_and_nesting_merge_inner_wins():
    @tightfit.hint(**{"acme.tile": 4}, slices=2)
    def inner(s):
        return s * 3

    def fn(x):
        y = x + 1
        with tightfit.hint(schedule="dfs", slices=8):
            s = y.softmax(-1)
            z = inner(s)
        return z.sum()

    assert torch.equal(fn(torch.ones(4, 4)), torch.tensor(12.0))  # the decorator keeps the function working
    outer, nested = traced_hints(fn, torch.randn(4, 4))
    assert dict(outer.hints) == {"schedule": "dfs", "slices": 8}
    assert dict(nested.hints) == {"schedule": "dfs", "slices": 2, "acme.tile": 4}
    assert dict(nested.declared) == {"acme.tile": 4, "slices": 2}
    assert nested.parent == outer.id and outer.parent is None
    assert set(nested.nodes) < set(outer.nodes)
    assert outer.where.startswith("test_hint.py:")


def test_each_call_of_a_decorated_function_is_its_own_region():
    @tightfit.hint(order="as_written")
    def block(x):
        return x.relu()

    regions = traced_hints(lambda x: block(block(x)), torch.randn(4))
    assert len(regions) == 2 and regions[0].id != regions[1].id


def test_hints_add_no_recompiles_and_no_guards_on_hint_state():
    calls = []

    def backend(graph_module, example_inputs):
        calls.append(1)
        return graph_module.forward

    def fn(x):
        with tightfit.hint(schedule="dfs", slices=2):
            with tightfit.hint(slices=4):
                return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    for _ in range(3):
        compiled(torch.randn(3))
    assert len(calls) == 1


def test_hint_scope_repr_and_decorating_a_non_callable():
    scope = tightfit.hint(schedule="bfs")
    assert repr(scope) == "tightfit.hint(schedule='bfs')"
    with pytest.raises(TypeError, match="decorates a callable"):
        scope(3)


def test_hints_survive_a_graph_break_before_the_region():
    def fn(x):
        y = x + 1
        torch._dynamo.graph_break()
        with tightfit.hint(order="as_written"):
            return y * 2

    regions = traced_hints(fn, torch.ones(2))
    assert [dict(region.hints) for region in regions] == [{"order": "as_written"}]
    assert torch.equal(torch.compile(fn, backend="eager")(torch.ones(2)), torch.full((2,), 4.0))


def test_a_scope_made_outside_a_compiled_function_still_runs():
    scope = tightfit.hint(schedule="bfs")

    def fn(x):
        with scope:  # dynamo cannot trace a context manager made outside: it runs fn eagerly
            y = x + 1
        with tightfit.hint(order="as_written"):
            return y * 2

    torch._dynamo.reset()
    for _ in range(2):
        assert torch.equal(torch.compile(fn, backend="eager")(torch.ones(2)), torch.full((2,), 4.0))

"""``dispatch_op``: a functional op on the dispatcher, the same op to every caller as ``torch.library.custom_op``'s,
with no autograd and a clear error where one would be needed; every functional minidi op is one."""

import pytest
import torch

import minidi.ops  # noqa: F401  (registers minidi's ops)
import minidi.runtime.expert_parallel  # noqa: F401  (minidi::rotated_blocks)
from minidi.ops._dispatch_op import DispatchOp, dispatch_op, impl_of
from minidi.runtime.kernel_precompile import _real_impl


def _scaled_rows(x: torch.Tensor, rows: list[int], scale: float, bias: torch.Tensor | None, flip: bool) -> torch.Tensor:
    y = x[rows] * scale
    if bias is not None:
        y = y + bias
    return -y if flip else y


def _scaled_rows_fake(x, rows, scale, bias, flip):
    return x.new_empty(len(rows), *x.shape[1:])


_op = dispatch_op("minidi_test::scaled_rows")(_scaled_rows)
_op.register_fake(_scaled_rows_fake)


def test_the_schema_is_custom_ops():
    assert isinstance(_op, DispatchOp)
    want = torch.library.infer_schema(_scaled_rows, mutates_args=())
    assert str(_op.op._schema) == "minidi_test::scaled_rows" + want


def test_calls_equal_the_function_eagerly_and_compiled():
    x, bias = torch.randn(7, 5), torch.randn(5)
    want = _scaled_rows(x, [4, 0, 4], 0.5, bias, True)
    assert torch.equal(_op(x, [4, 0, 4], 0.5, bias, True), want)
    assert torch.equal(torch.ops.minidi_test.scaled_rows(x, [4, 0, 4], 0.5, bias, True), want)
    compiled = torch.compile(lambda a, b: _op(a, [1, 2], 2.0, b, False) + 1, fullgraph=True, dynamic=True)
    for rows in (7, 11):
        a, b = torch.randn(rows, 3), torch.randn(3)
        assert torch.allclose(compiled(a, b), _scaled_rows(a, [1, 2], 2.0, b, False) + 1)


def test_opcheck():
    torch.library.opcheck(_op.op, (torch.randn(6, 4), [5, 1], 3.0, None, False))
    torch.library.opcheck(_op.op, (torch.randn(6, 4), [0], -1.0, torch.randn(4), True))


def test_an_input_that_requires_grad_is_refused_by_name_unless_grad_is_off():
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="minidi_test::scaled_rows has no autograd"):
        _op(x, [0], 1.0, None, False)
    with pytest.raises(RuntimeError, match="has no autograd"):  # a tensor anywhere in the arguments
        _op(torch.randn(4, 3), [0], 1.0, torch.randn(3, requires_grad=True), False)
    with torch.no_grad():
        assert torch.equal(_op(x, [2], 1.0, None, False), x.detach()[[2]])
    assert torch.equal(_op(x.detach(), [1], 1.0, None, False), x.detach()[[1]])  # grad on, nothing requires it


def test_impl_of_and_the_precompilers_lookup():
    assert impl_of(_op) is _scaled_rows
    assert impl_of(_op.op) is _scaled_rows
    assert impl_of(torch.ops.minidi_test.scaled_rows) is _scaled_rows
    assert impl_of(torch.ops.aten.add.Tensor) is None and impl_of(_scaled_rows) is None
    assert _real_impl(_op.op, (torch.randn(2, 2), [0], 1.0, None, False), {}) is _scaled_rows


def test_a_name_without_a_namespace_is_refused():
    with pytest.raises(ValueError, match="'namespace::op'"):
        dispatch_op("scaled_rows_2")(_scaled_rows)


def test_every_minidi_op_is_a_dispatch_op():
    names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("minidi::")})
    assert len(names) > 30, names
    assert "minidi::stage_mark" in names  # the one that declares a written argument
    assert [n for n in names if impl_of(torch.ops.minidi.__getattr__(n[8:])) is None] == []


def _add_rows_(x: torch.Tensor, rows: list[int], value: float) -> None:
    x[rows] += value


_mut = dispatch_op("minidi_test::add_rows_", mutates_args=("x",))(_add_rows_)
_mut.register_fake(lambda x, rows, value: None)


def test_a_written_argument_is_declared_and_compiled_code_keeps_the_write_in_order():
    want = torch.library.infer_schema(_add_rows_, mutates_args=("x",))
    assert str(_mut.op._schema) == "minidi_test::add_rows_" + want and want.startswith("(Tensor(a0!) x,")

    def f(a: torch.Tensor) -> torch.Tensor:
        b = a * 2  # written before the op, read after it
        before = b.sum()
        _mut(b, [0, 2], 1.5)
        return b + before

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    for _ in range(2):
        a = torch.randn(4, 3)
        assert torch.allclose(compiled(a), f(a), rtol=0, atol=1e-5)  # (out of order: off by 1.5 or 3)
    a = torch.randn(3, 2)
    torch.library.opcheck(_mut.op, (a, [1], -2.0))

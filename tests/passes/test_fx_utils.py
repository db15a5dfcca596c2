"""fx_utils.op: one canonical name per call, whatever form the torch version records it in."""

import operator

import torch
from torch.fx import Graph

from minidi.passes.fx_utils import is_call, op


def _node(kind: str, target):
    g = Graph()
    x = g.placeholder("x")
    return g.call_method(target, (x, 0)) if kind == "method" else g.call_function(target, (x, 0))


def test_dunder_method_and_operator_are_the_same_call():
    # torch 2.11 records `b == 0` on a tensor as the method __eq__, torch 2.13 as operator.eq
    assert op(_node("method", "__eq__")) == op(_node("function", operator.eq)) == "eq"
    assert op(_node("method", "__and__")) == op(_node("function", operator.and_)) == "and"
    assert op(_node("method", "__rshift__")) == op(_node("function", operator.rshift)) == "rshift"
    assert is_call(_node("method", "__eq__"), "eq") and not is_call(_node("method", "__ne__"), "eq")


def test_plain_methods_keep_their_name():
    assert op(_node("method", "float")) == "float"
    assert op(_node("function", torch.where)) == "where"

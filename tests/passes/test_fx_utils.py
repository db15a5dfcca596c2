"""fx_utils.op: one canonical name per call, whatever form the torch version records it in."""

import operator

import torch
from torch.fx import Graph

from minidi.passes.fx_utils import const_number, is_call, op


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


def test_mutation_between_a_one_node_subgraph_and_after_it():
    """Nothing lies strictly between a node and itself, and a mutation after the anchor does not count (pass G's
    one-node einsum matched only the last of 20 sites while this scanned to the end of the graph)."""
    from minidi.passes.fx_utils import mutation_between

    def f(x, buf):
        y = x * 2
        z = y + 1
        buf.add_(1)
        return z

    gm = torch.fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    mul, add, add_ = nodes["mul"], nodes["add"], nodes["add_"]
    assert mutation_between(gm.graph, add, add, [add]) is None
    assert mutation_between(gm.graph, mul, add, [mul, add]) is None
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert mutation_between(gm.graph, mul, out, [mul]) is add_


def test_const_number_sees_literals_and_negated_lifted_floats():
    g = Graph()
    x = g.placeholder("x")
    neg = g.call_function(operator.neg, (10.0,))  # how Dynamo records -limit for a float it made symbolic
    negneg = g.call_function(operator.neg, (neg,))
    assert const_number(neg) == -10.0 and const_number(negneg) == 10.0
    assert const_number(3) == 3 and const_number(2.5) == 2.5
    assert const_number(x) is None and const_number(g.call_function(operator.neg, (x,))) is None
    assert const_number(True) is None and const_number("a") is None

"""The partition of each stage's backward into input-gradient (B) and weight-gradient (W) nodes
(poptorch_lite.compiler.backward_split), on random graphs: B is exactly what the values leaving
the stage's backward depend on, W only feeds W of its own stage, and the labels can be undone."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from poptorch_lite.compiler.backward_split import WEIGHT_GRADIENT, partition_backward
from poptorch_lite.compiler.ir import IRGraph, Node, Value


@st.composite
def graphs(draw):
    """Forward nodes then backward nodes on up to 4 stages, each reading earlier values."""
    ir = IRGraph()
    values = [Value((2,), np.dtype(np.float32), f"x{i}", kind="input") for i in range(2)]
    ir.inputs = list(values)
    stages = draw(st.integers(1, 4))
    passes = ["fwd"] * draw(st.integers(1, 8)) + ["bwd"] * draw(st.integers(1, 16))
    for i, pass_ in enumerate(passes):
        inputs = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique_by=id))
        outputs = [Value((2,), np.dtype(np.float32), f"v{i}_{j}") for j in range(draw(st.integers(1, 2)))]
        node = Node("binary", inputs, outputs, pass_=pass_, stage=draw(st.integers(0, stages - 1)))
        for v in outputs:
            v.producer = node
        ir.nodes.append(node)
        values += outputs
    made_in_backward = [v for n in ir.nodes if n.pass_ == "bwd" for v in n.outputs]
    for i, v in enumerate(draw(st.lists(st.sampled_from(made_in_backward), max_size=4, unique_by=id))):
        ir.grads[f"w{i}"] = v
    return ir


def leaves_its_program(v, n, ir):
    return any(v in m.inputs and (m.pass_ == "fwd" or m.stage != n.stage) for m in ir.nodes)


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_b_is_what_leaves_the_stage_backward_and_w_the_rest(ir):
    backward = [n for n in ir.nodes if n.pass_ == "bwd"]
    partition_backward(ir, True)
    assert [n for n in ir.nodes if n.pass_ in ("bwd", WEIGHT_GRADIENT)] == backward
    b_nodes = [n for n in backward if n.pass_ == "bwd"]
    w_nodes = [n for n in backward if n.pass_ == WEIGHT_GRADIENT]
    for n in w_nodes:   # W feeds only W of its own stage (its other results are gradients)
        for v in n.outputs:
            for m in ir.nodes:
                if v in m.inputs:
                    assert m.pass_ == WEIGHT_GRADIENT and m.stage == n.stage
    # every B node is needed: some value leaving its stage's backward depends on it within the stage
    sources = [n for n in b_nodes if any(leaves_its_program(v, n, ir) for v in n.outputs)]
    reached, frontier = set(), list(sources)
    while frontier:
        n = frontier.pop()
        if id(n) not in reached:
            reached.add(id(n))
            frontier += [v.producer for v in n.inputs if v.producer is not None and v.producer.pass_ == "bwd"
                         and v.producer.stage == n.stage]
    assert reached == {id(n) for n in b_nodes}
    labels = [n.pass_ for n in ir.nodes]
    partition_backward(ir, True)
    assert [n.pass_ for n in ir.nodes] == labels   # idempotent
    partition_backward(ir, False)
    assert all(n.pass_ == "bwd" for n in backward)  # undone for a schedule with whole backwards

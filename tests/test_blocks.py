"""Block annotations: eager no-ops, trace state, auto ids, BeginBlock, removeBlocks."""

import pytest
import torch
import torch.nn as nn

from poptorch_lite.api.blocks import (
    DEFAULT_REGION,
    BeginBlock,
    LegacyBeginBlockFn,
    BeginBlockHook,
    Block,
    BlockError,
    BlockFunction,
    BlockRef,
    active_trace,
    block_annotation,
    removeBlocks,
    tracing_blocks,
)


class Annotated(nn.Module):
    """Uses every kind of block annotation."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)
        BeginBlock(self.c, "C", ipu_id=2)

    @BlockFunction("F", ipu_id=1)
    def middle(self, x):
        return torch.relu(self.b(x))

    def forward(self, x):
        Block.useAutoId()
        with Block(ipu_id=0):
            x = self.a(x)
        x = self.middle(x)
        Block.start("S", ipu_id=1)
        x = x * 2
        return self.c(x)


def test_blocks_have_no_effect_in_eager_mode():
    torch.manual_seed(0)
    annotated = Annotated()
    plain = nn.Sequential(annotated.a, nn.Identity(), annotated.b, nn.ReLU())
    x = torch.randn(3, 4)
    expected = annotated.c(plain(x) * 2)
    assert torch.equal(annotated(x), expected)
    assert active_trace() is None


def test_eager_blocks_leave_no_state_behind():
    with Block("A", ipu_id=0) as block:
        assert block.user_id == "A"
    Block.start("B")
    Block.useAutoId()
    assert active_trace() is None


def test_with_block_starts_and_closes():
    with tracing_blocks() as trace:
        assert trace.active == DEFAULT_REGION
        with Block("A", ipu_id=3):
            assert trace.active == BlockRef("A", 3)
        assert trace.active is None
        assert trace.last_closed == BlockRef("A", 3)


def test_blocks_do_not_nest_leaving_inner_block_leaves_none_active():
    with tracing_blocks() as trace:
        with Block("outer"):
            with Block("inner"):
                pass
            assert trace.active is None


def test_block_start_lasts_until_next_block():
    with tracing_blocks() as trace:
        Block.start("A", ipu_id=0)
        assert trace.active == BlockRef("A", 0)
        Block.start("B")
        assert trace.active == BlockRef("B", None)


def test_auto_ids_count_unnamed_blocks_in_start_order():
    with tracing_blocks() as trace:
        seen = []
        with Block():
            seen.append(trace.active.user_id)
        with Block("named"):
            seen.append(trace.active.user_id)
        with Block(ipu_id=1):
            seen.append(trace.active.user_id)
        Block.start()
        seen.append(trace.active.user_id)
        assert seen == ["0", "named", "1", "2"]


def test_use_auto_id_restarts_numbering():
    with tracing_blocks() as trace:
        with Block():
            pass
        with Block():
            pass
        Block.useAutoId()
        with Block():
            assert trace.active.user_id == "0"


def test_each_trace_starts_auto_ids_at_zero():
    for _ in range(2):
        with tracing_blocks() as trace:
            with Block():
                assert trace.active.user_id == "0"


def test_tracing_blocks_restores_previous_state():
    with tracing_blocks() as outer:
        with tracing_blocks() as inner:
            assert active_trace() is inner
        assert active_trace() is outer
    assert active_trace() is None


def test_begin_block_on_leaf_module_records_annotation_and_hook():
    linear = nn.Linear(2, 2)
    assert BeginBlock(linear, "L", ipu_id=1) is linear
    hook = block_annotation(linear)
    assert isinstance(hook, BeginBlockHook)
    assert (hook.user_id, hook.ipu_id) == ("L", 1)
    assert repr(hook) == "BeginBlock(user_id='L', ipu_id=1)"
    with tracing_blocks() as trace:
        linear(torch.ones(1, 2))
        assert trace.active == BlockRef("L", 1)


def test_begin_block_on_non_leaf_module_starts_when_called():
    model = Annotated()
    BeginBlock(model.b, "inner", ipu_id=5)
    with tracing_blocks() as trace:
        Block.start("before")
        model.b(torch.ones(1, 4))
        assert trace.active == BlockRef("inner", 5)


def test_unnamed_begin_block_keeps_its_auto_id_within_a_trace():
    layer = BeginBlock(nn.ReLU())
    with tracing_blocks() as trace:
        layer(torch.ones(1))
        first = trace.active
        with Block():
            assert trace.active.user_id == "1"
        layer(torch.ones(1))
        assert trace.active == first == BlockRef("0", None)


def test_begin_block_twice_is_an_error():
    linear = BeginBlock(nn.Linear(2, 2), "A")
    with pytest.raises(BlockError, match="module has already been assigned to a block.*removeBlocks"):
        BeginBlock(linear, "B")


def test_begin_block_wraps_functions_and_rejects_other_values():
    wrapped = BeginBlock(lambda x: x * 2, "A", ipu_id=1)
    assert isinstance(wrapped, LegacyBeginBlockFn) and wrapped(torch.tensor(3.0)) == 6.0
    with pytest.raises(BlockError, match="a torch.nn.Module or a function, got int"):
        BeginBlock(3, "A")


def test_remove_blocks_removes_annotations_recursively():
    model = Annotated()
    BeginBlock(model, "root")
    other = model.a.register_forward_pre_hook(lambda m, a: None)
    removeBlocks(model)
    assert all(block_annotation(m) is None for m in model.modules())
    assert len(model.a._forward_pre_hooks) == 1  # the user's own hook stays
    other.remove()
    with tracing_blocks() as trace:
        model.c(torch.ones(1, 4))
        assert trace.active == DEFAULT_REGION
    BeginBlock(model.c, "again")  # can be annotated again


def test_block_function_runs_in_its_block_and_keeps_metadata():
    @BlockFunction("F", ipu_id=2)
    def double(x):
        """Doubles."""
        trace = active_trace()
        return x * 2, None if trace is None else trace.active

    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert double(1) == (2, None)
    with tracing_blocks() as trace:
        assert double(1) == (2, BlockRef("F", 2))
        assert trace.active is None


@pytest.mark.parametrize(
    "user_id, ipu_id",
    [(3.0, None), (True, None), ("", None), ("A", -1), ("A", 1.0), ("A", True), ("A", "0")],
)
def test_invalid_ids_are_rejected(user_id, ipu_id):
    with pytest.raises(BlockError):
        Block(user_id, ipu_id)
    with pytest.raises(BlockError):
        Block.start(user_id, ipu_id)
    with pytest.raises(BlockError):
        BlockFunction(user_id, ipu_id)
    with pytest.raises(BlockError):
        BeginBlock(nn.ReLU(), user_id, ipu_id)


def test_block_ref_text():
    assert str(DEFAULT_REGION) == "(before first block)"
    assert str(BlockRef("B1")) == "'B1'"
    assert str(BlockRef("B1", 2)) == "'B1' (ipu_id=2)"


def test_integer_user_ids_name_blocks_and_survive_copies_and_saving():
    """PopTorch's older code numbers its blocks (BeginBlock(m, user_id=1, ipu_id=2)); the id is
    kept as given, shown by module_repr, and kept by copy, deepcopy and torch.save."""
    import copy
    import io
    from poptorch_lite.api.blocks import module_repr
    seq = nn.Sequential(BeginBlock(nn.ReLU(), user_id=1, ipu_id=1), BeginBlock(nn.ReLU(), user_id=2, ipu_id=2))
    for m in (seq, copy.copy(seq), copy.deepcopy(seq)):
        assert "BeginBlock(user_id=1, ipu_id=1)" in module_repr(m[0])
        assert "BeginBlock(user_id=2, ipu_id=2)" in module_repr(m[1])
    with tracing_blocks() as trace:
        seq[1](torch.ones(1))
        assert trace.active == BlockRef(2, 2)
    legacy = BeginBlock(lambda x: x + 1, 1, 2)
    assert (legacy._user_id, legacy._ipu_id) == (1, 2)
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    buffer.seek(0)
    assert "BeginBlock(user_id=2, ipu_id=2)" in module_repr(torch.load(buffer, weights_only=False)[1])
    for bad in (True, "", 1.5):
        with pytest.raises(BlockError, match="user_id must be a non-empty string, an integer or None"):
            Block(bad)

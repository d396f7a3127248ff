"""A fused checkpoint tensor that a model's own ``load_weights`` reorders before its
``weight_loader`` sees it (Bloom's ``query_key_value``, interleaved per head, turned into
``[q | k | v]``): the load record matches what the loader wrote against the tensor as the
checkpoint holds it (integrations/vllm_load.py), so the rows are recorded in the order written,
and the comparator gathers that output back into the checkpoint's order (compare/pair/correspondence.py
``tensor_parallel_joins`` for one rank, compare/pair/unshard.py). A plain torch model stands for the
engine's: the record relies on ``load_weights`` and each parameter's ``weight_loader`` only."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tracedump.compare.load.sources import PassView
from tracedump.compare.pair.rank_joins import tensor_parallel_joins
from tracedump.compare.pair.unshard import assemble, plan_entry
from tracedump.integrations.vllm_load import recording
from tracedump.store.correspondence import Correspondence

HEADS, HEAD, HIDDEN = 2, 3, 4  # 2 heads of 3 rows each for q, k and v: 18 rows


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class Fused(nn.Module):
    """A fused qkv whose checkpoint layout is per head (``[q0 k0 v0 | q1 k1 v1]``) and whose own
    layout is ``[q | k | v]``, as vLLM's Bloom reorders it in ``load_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD, bias=False)
        self.qkv.weight.weight_loader = _copy  # type: ignore[attr-defined]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _name, tensor in weights:
            shape = tensor.shape
            moved = tensor.view(HEADS, 3, -1, *shape[1:]).transpose(0, 1).reshape(shape)
            self.qkv.weight.weight_loader(self.qkv.weight, moved)


def test_a_reordered_fused_tensor_is_recorded_in_the_order_written_and_put_back() -> None:
    model = Fused()
    checkpoint = torch.randn(3 * HEADS * HEAD, HIDDEN)
    with recording(model) as record:
        assert record is not None
        model.load_weights([("qkv.weight", checkpoint)])
    (load,) = record.loads
    # own rows [q0 q1 | k0 k1 | v0 v1] came from the checkpoint's q0=0, q1=9, k0=3, k1=12, v0=6, v1=15
    assert load.rows == [[0, 0, 3], [3, 9, 3], [6, 3, 3], [9, 12, 3], [12, 6, 3], [15, 15, 3]]
    corr = Correspondence(
        parameters={"qkv.weight": {"shape": [18, HIDDEN]}}, sources=record.sources, loads=record.loads
    )
    (rule,) = tensor_parallel_joins([corr], {"qkv": "vllm.QKVParallelLinear"})
    assert rule.op == "gather" and rule.matches("qkv[0]") and not rule.matches("qkv")  # the engine's only
    x = torch.randn(5, HIDDEN)
    view = PassView(0, 0, {"qkv[0]": model.qkv(x).detach()})
    entry = plan_entry("qkv[0]", [view], rule)
    back = torch.from_numpy(assemble(entry, [view]).array.copy())
    torch.testing.assert_close(back, x @ checkpoint.T)  # the checkpoint's row order: HF's output

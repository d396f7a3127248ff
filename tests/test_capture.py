"""Tests for the interactive in-memory capture (``tracedump.capture``).

Real-model tests use a tiny Llama built from a config with random weights (no download).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import make_tiny_llama
from torch import nn

from tracedump.dump.capture import Capture, CaptureSpec, ModuleCapture, capture, parse_spec

pytest.importorskip("transformers")

VOCAB = 64
LAYERS = 4
HIDDEN = 32


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return make_tiny_llama(layers=LAYERS)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def input_ids() -> torch.Tensor:
    return _ids()


@contextlib.contextmanager
def _count_calls(model: nn.Module) -> Iterator[collections.Counter[str]]:
    """Count forward calls of every module (by name) while the block runs."""
    calls: collections.Counter[str] = collections.Counter()
    handles = []
    for name, module in model.named_modules():

        def pre_hook(_module: nn.Module, _args: tuple, name: str = name) -> None:
            calls[name] += 1

        handles.append(module.register_forward_pre_hook(pre_hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _hook_ids(model: nn.Module) -> dict[str, tuple[frozenset[int], ...]]:
    """Ids of every forward (pre-)hook per module, to compare before/inside/after a capture block."""
    return {
        name: (
            frozenset(module._forward_hooks),
            frozenset(module._forward_pre_hooks),
            frozenset(module._forward_pre_hooks_with_kwargs),
            frozenset(module._forward_hooks_with_kwargs),
        )
        for name, module in model.named_modules()
    }


def _changed_modules(before: dict, after: dict) -> set[str]:
    return {name for name in before if before[name] != after[name]}


def _layer0_hidden(entry: dict) -> torch.Tensor:
    """Decoder layers get hidden_states positionally or as a keyword, depending on transformers' version."""
    return entry["args"][0] if entry["args"] else entry["kwargs"]["hidden_states"]


# ------------------------------------------------------------------------------------------- toys

Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Box:
    value: torch.Tensor
    tag: str


class Structured(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[Pair, Box]:
        return Pair(x * 2, [x + 1, {"a": x - 1, "note": "keep", "none": None}]), Box(x * 3, "box")


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


class Toy(nn.Module):
    """identity -> first -> scaled(scale=...) -> structured -> last; ``unused`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.identity = nn.Identity()
        self.first = nn.Linear(4, 4)
        self.scaled = Scaled()
        self.structured = Structured()
        self.unused = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.scaled(self.first(self.identity(x)), scale=scale)
        pair, _box = self.structured(h)
        return self.last(pair.first)


@pytest.fixture
def toy() -> Toy:
    return Toy().eval()


# ------------------------------------------------------------------------------- values on a real model


def test_layer0_inputs_equal_the_embedding_output(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with capture(llama, inputs=["model.layers.0"], outputs=["model.embed_tokens"]) as cap:
        cap.run(input_ids=input_ids)

    (entry,) = cap["model.layers.0"].inputs
    assert set(entry) == {"args", "kwargs"}
    hidden = _layer0_hidden(entry)
    torch.testing.assert_close(hidden, cap["model.embed_tokens"].outputs[0], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(hidden, llama.model.embed_tokens(input_ids), rtol=0, atol=0)


def test_layer_outputs_equal_the_output_hidden_states_entries(
    llama: nn.Module, input_ids: torch.Tensor
) -> None:
    # The last hidden_states entry is the final-norm output, so compare every layer but the last.
    layers = [f"model.layers.{i}" for i in range(LAYERS - 1)]
    with torch.no_grad(), capture(llama, outputs=layers) as cap:
        out = cap.run(input_ids=input_ids, output_hidden_states=True)

    assert out.logits.shape == (2, 7, VOCAB)
    for i, name in enumerate(layers):
        (captured,) = cap[name].outputs
        assert captured.shape == (2, 7, HIDDEN)
        torch.testing.assert_close(captured, out.hidden_states[i + 1], rtol=0, atol=0)


def test_capture_does_not_change_model_outputs(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad():
        expected = llama(input_ids=input_ids).logits
        with capture(llama, filter=[r"."], inputs=["model.layers.1"]) as cap:
            got = cap.run(input_ids=input_ids).logits

    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(cap["lm_head"].outputs[0], expected, rtol=0, atol=0)


def test_kwargs_are_captured(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad(), capture(llama, inputs=["model.layers.0"], outputs=["model.rotary_emb"]) as cap:
        cap.run(input_ids=input_ids)

    kwargs = cap["model.layers.0"].inputs[0]["kwargs"]
    assert {"position_embeddings", "position_ids", "attention_mask"} <= set(kwargs)
    cos, sin = kwargs["position_embeddings"]
    expected_cos, expected_sin = cap["model.rotary_emb"].outputs[0]
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=0)
    torch.testing.assert_close(kwargs["position_ids"], torch.arange(7).unsqueeze(0), rtol=0, atol=0)


def test_kwargs_and_args_are_kept_apart(toy: Toy) -> None:
    x = torch.randn(3, 4)
    with torch.no_grad(), capture(toy, inputs=["scaled"], outputs=["first"]) as cap:
        cap.run(x, scale=2.5)

    (entry,) = cap["scaled"].inputs
    assert entry["kwargs"] == {"scale": 2.5}
    assert isinstance(entry["args"], tuple) and len(entry["args"]) == 1
    torch.testing.assert_close(entry["args"][0], cap["first"].outputs[0], rtol=0, atol=0)


def test_model_output_keeps_its_class(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad(), capture(llama, outputs=["model"]) as cap:
        out = cap.run(input_ids=input_ids, output_hidden_states=True)

    (captured,) = cap["model"].outputs
    assert type(captured).__name__ == "BaseModelOutputWithPast"
    assert "last_hidden_state" in captured and "hidden_states" in captured
    assert len(captured.hidden_states) == LAYERS + 1
    torch.testing.assert_close(captured.last_hidden_state, out.hidden_states[-1], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ early exit


def test_early_exit_skips_later_layers_and_returns_none(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad(), capture(llama, outputs=["model.layers.0"]) as reference:
        reference.run(input_ids=input_ids)

    with (
        torch.no_grad(),
        capture(llama, outputs=["model.layers.0"], early_exit=True) as cap,
        _count_calls(llama) as calls,
    ):
        result = cap.run(input_ids=input_ids)

    assert result is None
    assert calls["model.layers.0"] == 1
    assert calls["model.layers.1"] == 0
    assert calls["model.layers.3"] == 0
    assert calls["model.norm"] == 0
    assert calls["lm_head"] == 0
    (captured,) = cap["model.layers.0"].outputs
    torch.testing.assert_close(captured, reference["model.layers.0"].outputs[0], rtol=0, atol=0)


def test_early_exit_is_rearmed_for_every_run(llama: nn.Module) -> None:
    batches = [_ids(seed) for seed in (1, 2, 3)]
    with torch.no_grad(), capture(llama, outputs=["model.layers.1"]) as reference:
        for ids in batches:
            reference.run(input_ids=ids)

    with (
        torch.no_grad(),
        capture(llama, outputs=["model.layers.1"], early_exit=True) as cap,
        _count_calls(llama) as calls,
    ):
        results = [cap.run(input_ids=ids) for ids in batches]

    assert results == [None, None, None]
    assert calls["model.layers.1"] == 3
    assert calls["model.layers.2"] == 0
    assert len(cap["model.layers.1"].outputs) == 3
    for got, expected in zip(cap["model.layers.1"].outputs, reference["model.layers.1"].outputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_early_exit_waits_for_a_blocks_output_after_its_children(
    llama: nn.Module, input_ids: torch.Tensor
) -> None:
    # Post-order: layers.0 output fires after layers.0.mlp, so both are recorded before the cut.
    names = ["model.layers.0", "model.layers.0.mlp"]
    with torch.no_grad(), capture(llama, outputs=names, early_exit=True) as cap, _count_calls(llama) as calls:
        assert cap.run(input_ids=input_ids) is None

    assert len(cap["model.layers.0"].outputs) == 1
    assert len(cap["model.layers.0.mlp"].outputs) == 1
    assert calls["model.layers.1"] == 0


def test_early_exit_cuts_at_an_input_capture_before_the_module_runs(
    llama: nn.Module, input_ids: torch.Tensor
) -> None:
    with (
        torch.no_grad(),
        _count_calls(llama) as calls,  # registered first, so its pre-hook runs before the cut
        capture(llama, outputs=["model.layers.0.mlp"], inputs=["model.layers.2"], early_exit=True) as cap,
    ):
        assert cap.run(input_ids=input_ids) is None

    assert calls["model.layers.1"] == 1
    assert calls["model.layers.2"] == 1  # the pre-hook fired...
    assert calls["model.layers.2.input_layernorm"] == 0  # ...but its forward never started
    assert len(cap["model.layers.2"].inputs) == 1
    assert _layer0_hidden(cap["model.layers.2"].inputs[0]).shape == (2, 7, HIDDEN)
    assert len(cap["model.layers.0.mlp"].outputs) == 1


def test_early_exit_completes_the_forward_when_a_requested_module_never_runs(toy: Toy) -> None:
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = toy(x)
        with capture(toy, outputs=["first", "unused"], early_exit=True) as cap, _count_calls(toy) as calls:
            result = cap.run(x)

    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert calls["last"] == 1
    assert len(cap["first"].outputs) == 1
    assert cap["unused"].outputs == []


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_early_exit_works_under_grad_modes(
    llama: nn.Module, input_ids: torch.Tensor, grad_mode: Callable[[], contextlib.AbstractContextManager]
) -> None:
    with torch.no_grad(), capture(llama, outputs=["model.layers.1"]) as reference:
        reference.run(input_ids=input_ids)

    with (
        capture(llama, outputs=["model.layers.1"], early_exit=True) as cap,
        _count_calls(llama) as calls,
        grad_mode(),
    ):
        assert cap.run(input_ids=input_ids) is None

    assert calls["model.layers.2"] == 0
    (captured,) = cap["model.layers.1"].outputs
    torch.testing.assert_close(captured, reference["model.layers.1"].outputs[0], rtol=0, atol=0)
    # Captures are ordinary tensors even from inference mode, so they can serve as training targets.
    assert not captured.is_inference()
    student = torch.zeros_like(captured, requires_grad=True)
    torch.nn.functional.mse_loss(student, captured).backward()
    assert student.grad is not None and student.grad.shape == captured.shape


def test_plain_model_calls_inside_the_block_are_captured_but_never_cut_short(
    llama: nn.Module, input_ids: torch.Tensor
) -> None:
    with (
        torch.no_grad(),
        capture(llama, outputs=["model.layers.0"], early_exit=True) as cap,
        _count_calls(llama) as calls,
    ):
        out = llama(input_ids=input_ids)

    assert out.logits.shape == (2, 7, VOCAB)
    assert calls["lm_head"] == 1
    assert len(cap["model.layers.0"].outputs) == 1


def test_early_exit_on_a_deep_model_never_runs_the_rest() -> None:
    deep = make_tiny_llama(layers=48)
    with (
        torch.no_grad(),
        capture(deep, outputs=["model.layers.0"], early_exit=True) as cap,
        _count_calls(deep) as calls,
    ):
        assert cap.run(input_ids=_ids()) is None

    ran = {name for name, count in calls.items() if count}
    allowed_outside_layer0 = {"", "model", "model.embed_tokens", "model.rotary_emb"}
    assert ran - allowed_outside_layer0 <= {
        name for name, _ in deep.named_modules() if name.startswith("model.layers.0")
    }
    assert "model.layers.0.mlp" in ran
    assert not any(name.startswith(f"model.layers.{i}") for i in range(1, 48) for name in ran)
    assert len(cap["model.layers.0"].outputs) == 1


# ------------------------------------------------------------------------------------------- copies


def test_captured_tensors_are_detached_copies(llama: nn.Module, input_ids: torch.Tensor, toy: Toy) -> None:
    with capture(llama, outputs=["model.layers.0"], early_exit=True) as cap:
        cap.run(input_ids=input_ids)  # grad enabled: the live activation has a grad_fn
    captured = cap["model.layers.0"].outputs[0]
    assert not captured.requires_grad and captured.grad_fn is None

    x = torch.randn(3, 4)
    with torch.no_grad(), capture(toy, outputs=["identity"], inputs=["identity"]) as cap:
        cap.run(x)
    original = x.clone()
    out, arg = cap["identity"].outputs[0], cap["identity"].inputs[0]["args"][0]
    assert out.data_ptr() != x.data_ptr() and arg.data_ptr() != x.data_ptr()
    x.add_(100.0)  # a later in-place update of the live tensor must not reach the records
    torch.testing.assert_close(out, original, rtol=0, atol=0)
    torch.testing.assert_close(arg, original, rtol=0, atol=0)


def test_nested_outputs_keep_their_structure_and_types(toy: Toy) -> None:
    x = torch.randn(3, 4)
    with torch.no_grad(), capture(toy, outputs=["structured", "scaled"]) as cap:
        cap.run(x)

    h = cap["scaled"].outputs[0]
    pair, box = cap["structured"].outputs[0]
    assert type(cap["structured"].outputs[0]) is tuple
    assert type(pair) is Pair and type(box) is Box
    assert type(pair.second) is list and type(pair.second[1]) is dict
    torch.testing.assert_close(pair.first, h * 2, rtol=0, atol=0)
    torch.testing.assert_close(pair.second[0], h + 1, rtol=0, atol=0)
    torch.testing.assert_close(pair.second[1]["a"], h - 1, rtol=0, atol=0)
    assert pair.second[1]["note"] == "keep" and pair.second[1]["none"] is None
    torch.testing.assert_close(box.value, h * 3, rtol=0, atol=0)
    assert box.tag == "box"


def test_device_moves_captures_and_none_leaves_them_in_place(toy: Toy) -> None:
    x = torch.randn(3, 4)
    with torch.no_grad(), capture(toy, outputs=["structured"], inputs=["scaled"], device="meta") as on_meta:
        on_meta.run(x, scale=torch.tensor(2.0))
    with torch.no_grad(), capture(toy, outputs=["structured"], inputs=["scaled"]) as in_place:
        in_place.run(x, scale=torch.tensor(2.0))

    pair, box = on_meta["structured"].outputs[0]
    assert {t.device.type for t in (pair.first, pair.second[0], pair.second[1]["a"], box.value)} == {"meta"}
    assert pair.first.shape == (3, 4)
    entry = on_meta["scaled"].inputs[0]
    assert entry["args"][0].device.type == "meta" and entry["kwargs"]["scale"].device.type == "meta"
    kept_pair, kept_box = in_place["structured"].outputs[0]
    assert kept_pair.first.device.type == "cpu" and kept_box.value.device.type == "cpu"
    assert in_place["scaled"].inputs[0]["kwargs"]["scale"].item() == 2.0


# ------------------------------------------------------------------------------------------------ spec


def test_parse_spec_reads_sections_and_drops_whitespace_and_empty_items() -> None:
    spec = " inputs[ model.layers.0 || ] | outputs[model.layers.0|  model.layers.5 |] ||"
    assert parse_spec(spec) == CaptureSpec(
        inputs=("model.layers.0",), outputs=("model.layers.0", "model.layers.5")
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("outputs[a]", CaptureSpec(inputs=(), outputs=("a",))),
        ("inputs[a.b]", CaptureSpec(inputs=("a.b",), outputs=())),
        ("a | b.c", CaptureSpec(inputs=(), outputs=("a", "b.c"))),
        ("a|inputs[b]", CaptureSpec(inputs=("b",), outputs=("a",))),
        ("outputs[a|b]|outputs[b|c]|a", CaptureSpec(inputs=(), outputs=("a", "b", "c"))),
    ],
)
def test_parse_spec_sections_are_optional_and_merge_without_duplicates(
    spec: str, expected: CaptureSpec
) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "   ", "|||", "inputs[]", "outputs[ | ]|inputs[]"])
def test_spec_that_selects_nothing_raises_value_error(spec: str) -> None:
    with pytest.raises(ValueError, match="selects nothing"):
        parse_spec(spec)


@pytest.mark.parametrize(
    "spec", ["grads[a]", "outputs[a", "outputs[a]]", "a]", "outputs[a]b", "outputs[a[b]]"]
)
def test_malformed_spec_raises_value_error(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_spec(spec)


def test_capture_with_a_spec_records_the_requested_sides(llama: nn.Module, input_ids: torch.Tensor) -> None:
    spec = "inputs[model.layers.0]|outputs[model.layers.0|model.layers.3]"
    with torch.no_grad(), capture(llama, spec=spec) as cap:
        out = cap.run(input_ids=input_ids, output_hidden_states=True)

    assert cap.names == ["model.layers.0", "model.layers.3"]
    assert len(cap["model.layers.0"].inputs) == 1 and len(cap["model.layers.0"].outputs) == 1
    assert cap["model.layers.3"].inputs == [] and len(cap["model.layers.3"].outputs) == 1
    torch.testing.assert_close(_layer0_hidden(cap["model.layers.0"].inputs[0]), out.hidden_states[0])
    torch.testing.assert_close(cap["model.layers.0"].outputs[0], out.hidden_states[1])


# ------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize(
    ("kwargs", "closest"),
    [
        ({"outputs": ["model.layer.0"]}, "model.layers.0"),
        ({"inputs": ["model.layers.0.selfattn"]}, "model.layers.0.self_attn"),
        ({"spec": "outputs[lm_heads]"}, "lm_head"),
    ],
)
def test_unknown_module_name_raises_key_error_listing_closest_names(
    llama: nn.Module, kwargs: dict, closest: str
) -> None:
    with pytest.raises(KeyError) as info:
        capture(llama, **kwargs)
    message = str(info.value)
    assert "no module named" in message and closest in message


def test_getitem_explains_unrequested_and_unknown_names(llama: nn.Module) -> None:
    cap = capture(llama, outputs=["model.layers.0"])
    assert isinstance(cap, Capture) and isinstance(cap["model.layers.0"], ModuleCapture)
    assert "model.layers.0" in cap and list(cap) == ["model.layers.0"] and len(cap) == 1
    with pytest.raises(KeyError, match="not requested"):
        cap["model.layers.1"]
    with pytest.raises(KeyError, match=r"closest: model\.layers\.1"):
        cap["model.layers.1x"]


def test_requesting_nothing_raises_value_error(llama: nn.Module) -> None:
    with pytest.raises(ValueError, match="nothing to capture"):
        capture(llama)
    with pytest.raises(ValueError, match="nothing to capture"):
        capture(llama, outputs=[], inputs=[])


# ------------------------------------------------------------------------------------------- filter


def test_filter_captures_outputs_of_all_matching_modules(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad(), capture(llama, filter=[r"layers\.\d+\.mlp$"]) as cap:
        cap.run(input_ids=input_ids)

    assert cap.names == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    for name in cap:
        assert cap[name].inputs == []
        assert [t.shape for t in cap[name].outputs] == [(2, 7, HIDDEN)]


def test_filter_values_match_the_model_output(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with torch.no_grad(), capture(llama, filter=[r"^model\.norm$", "lm_head"]) as cap:
        out = cap.run(input_ids=input_ids, output_hidden_states=True)

    assert set(cap) == {"model.norm", "lm_head"}
    torch.testing.assert_close(cap["lm_head"].outputs[0], out.logits, rtol=0, atol=0)
    torch.testing.assert_close(cap["model.norm"].outputs[0], out.hidden_states[-1], rtol=0, atol=0)


def test_filter_is_combined_with_names_as_a_union(llama: nn.Module, input_ids: torch.Tensor) -> None:
    with (
        torch.no_grad(),
        capture(llama, filter="lm_head", outputs=["model.layers.0"], inputs=["model.layers.1"]) as cap,
    ):
        cap.run(input_ids=input_ids)

    assert set(cap) == {"lm_head", "model.layers.0", "model.layers.1"}
    assert len(cap["lm_head"].outputs) == 1 and len(cap["model.layers.0"].outputs) == 1
    assert len(cap["model.layers.1"].inputs) == 1 and cap["model.layers.1"].outputs == []


def test_invalid_filter_pattern_raises_value_error_naming_it(llama: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"layers\.\(0"):
        capture(llama, filter=["lm_head", "layers.(0"])


def test_filter_matching_nothing_raises_value_error(llama: nn.Module) -> None:
    with pytest.raises(ValueError, match="matches no module"):
        capture(llama, filter=[r"^decoder\."])


# -------------------------------------------------------------------------------------------- hooks


def _run_and_fail(cap: Capture, input_ids: torch.Tensor) -> None:
    cap.run(input_ids=input_ids)
    raise RuntimeError("user code failed")


def test_hooks_exist_only_on_requested_modules_and_only_inside_the_block(
    llama: nn.Module, input_ids: torch.Tensor
) -> None:
    before = _hook_ids(llama)
    requested = {"model.layers.0", "model.layers.2.mlp", "lm_head"}
    with capture(llama, outputs=["model.layers.0", "lm_head"], inputs=["model.layers.2.mlp"]) as cap:
        inside = _hook_ids(llama)
    after = _hook_ids(llama)

    assert _changed_modules(before, inside) == requested
    assert after == before
    with pytest.raises(RuntimeError, match="inside the `with"):
        cap.run(input_ids=input_ids)


@pytest.mark.parametrize("failure", ["user_code", "model_forward"])
def test_hooks_are_removed_after_an_exception(
    llama: nn.Module, input_ids: torch.Tensor, failure: str
) -> None:
    before = _hook_ids(llama)
    bad_ids = torch.full((1, 3), VOCAB + 10)  # out of range: the embedding raises IndexError
    expected: type[Exception] = RuntimeError if failure == "user_code" else IndexError
    with (
        pytest.raises(expected),
        capture(llama, outputs=["model.layers.0"], inputs=["model.embed_tokens"], early_exit=True) as cap,
    ):
        if failure == "user_code":
            _run_and_fail(cap, input_ids)
        cap.run(input_ids=bad_ids)

    assert _hook_ids(llama) == before
    with torch.no_grad():
        llama(input_ids=input_ids)  # a later plain forward records nothing more
    assert len(cap["model.layers.0"].outputs) == (1 if failure == "user_code" else 0)


def test_capture_can_be_reentered_and_cleared(llama: nn.Module, input_ids: torch.Tensor) -> None:
    cap = capture(llama, outputs=["model.layers.0"], early_exit=True)
    for _ in range(2):
        with torch.no_grad(), cap:
            cap.run(input_ids=input_ids)
    outputs = cap["model.layers.0"].outputs
    assert len(outputs) == 2
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    cap.clear()
    assert cap["model.layers.0"].outputs == [] and cap["model.layers.0"].inputs == []

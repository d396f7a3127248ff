"""What vLLM filled each parameter from, recorded during its weight load (dumping on only).

For the length of one ``model.load_weights(weights)`` call (:func:`recording`):

- the weights iterator is wrapped: each checkpoint tensor is tagged with its checkpoint name (the
  name vLLM read, before ``hf_to_vllm_mapper`` / ``stacked_params_mapping`` renamed it) and its
  shape, dtype and fingerprint are kept (``sources``);
- each parameter's ``weight_loader`` is wrapped: before the call the parameter's values are saved
  and it is filled with NaN; after it, the elements no longer NaN are the region the call wrote,
  the saved values are put back everywhere else, and the written block is matched row by row
  against the checkpoint tensor as the iterator yielded it (:func:`tracedump.dump.weights.source_slices`):
  a fused tensor that the model's ``load_weights`` reorders before the loader sees it is recorded
  with the rows it was written in, which the comparator puts back in order. The loaded numbers
  are never changed (a checkpoint tensor holding NaN is loaded untouched and not located);
- a parameter without a ``weight_loader`` (vLLM's ``default_weight_loader``, a whole copy) is
  found after the load by its values: the checkpoint tensor of its shape and fingerprint.

Every vLLM internal used is in :mod:`.vllm_compat`. The record reaches the run dir through the
public ``Dumper.record_weight_sources`` once the plugin has attached.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..dump.weights import block_of, fingerprint, source_slices, written_region
from ..store.correspondence import Load, fingerprints_match, shared_tail
from . import vllm_compat


class LoadRecord:
    """The checkpoint tensors one model's load read, and each parameter load, in call order."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.params = dict(model.named_parameters())
        self.sources: dict[str, dict[str, Any]] = {}
        self.loads: list[Load] = []
        self.current: str | None = None  # the checkpoint tensor being loaded
        self.tensor: torch.Tensor | None = None  # its values as read, before load_weights reorders them
        self.failures: list[str] = []  # loads whose record failed (the load itself went through)
        self.tp_rank, self.tp_size = vllm_compat.tensor_parallel()

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights iterator, each tensor's name noted before the model loads it."""
        for name, tensor in weights:
            self.current = name
            self.tensor = tensor if isinstance(tensor, torch.Tensor) else None
            if isinstance(tensor, torch.Tensor):
                self.sources[name] = {
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "fingerprint": fingerprint(tensor) if tensor.is_floating_point() else [],
                }
            yield name, tensor
        self.current, self.tensor = None, None

    def wrap(self, name: str, param: nn.Parameter, loader: Callable[..., Any]) -> Callable[..., Any]:
        """``loader`` with the region it writes recorded (see the module docstring)."""

        @functools.wraps(loader)
        def weight_loader(*args: Any, **kwargs: Any) -> Any:
            source = self.current
            target, loaded = vllm_compat.loader_call_tensors(args, kwargs)
            if (
                target is not param
                or source is None
                or not isinstance(loaded, torch.Tensor)
                or not param.is_floating_point()
                or not loaded.is_floating_point()
                or bool(torch.isnan(loaded).any())
            ):
                return loader(*args, **kwargs)
            with torch.no_grad():
                before = param.data.clone()
                param.data.fill_(float("nan"))
            try:
                result = loader(*args, **kwargs)
            except BaseException:
                with torch.no_grad():
                    param.data.copy_(before)
                raise
            with torch.no_grad():
                if param.data.shape != before.shape:  # the loader replaced the tensor: nothing to restore
                    return result
                written = ~torch.isnan(param.data)
                param.data.copy_(torch.where(written, param.data, before))
            self._note(name, source, param, loaded, written, args, kwargs)
            return result

        return weight_loader

    def _note(
        self,
        name: str,
        source: str,
        param: nn.Parameter,
        loaded: torch.Tensor,
        written: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        try:
            region = written_region(written)
            if region is None:
                return  # nothing written (an expert another rank holds), or not a box
            slices = self._slices(block_of(param.data, region), loaded)
            rest = args[2:] if len(args) >= 2 else ()
            shard, expert = vllm_compat.loader_call_ids((param, loaded, *rest), kwargs)
            self.loads.append(
                Load(
                    param=name,
                    source=source,
                    shard=shard,
                    expert=expert,
                    region=region,
                    rows=slices["rows"] if slices else None,
                    cols=slices["cols"] if slices else None,
                )
            )
        except Exception as e:  # the load itself went through: only its record is missing
            self.failures.append(f"{name} from {source}: {type(e).__name__}: {e}")

    def _slices(self, block: torch.Tensor, loaded: torch.Tensor) -> dict[str, Any] | None:
        """Where the written block came from in the checkpoint tensor as read: a model's own
        ``load_weights`` may reorder a fused tensor's rows before its ``weight_loader`` sees them
        (Bloom's and Falcon's ``query_key_value``, interleaved per head or grouped per KV head),
        so the rows are matched against the tensor the weights iterator yielded, and recorded in
        the order they were written; against the loader's own argument only when they are not in
        it (a tensor the model computed from several, or changed)."""
        read = self.tensor
        if read is not None and read is not loaded and read.is_floating_point():
            found = source_slices(block, read)
            if found is not None:
                return found
        return source_slices(block, loaded)

    def find_plain_copies(self) -> None:
        """Parameters loaded by ``default_weight_loader`` (no ``weight_loader`` to wrap): the
        checkpoint tensor of the same shape and values; of several, the one whose name shares the
        longest dotted tail with the parameter's."""
        done = {load.param for load in self.loads}
        by_shape: dict[tuple[int, ...], list[tuple[str, list[float]]]] = {}
        for source, meta in self.sources.items():
            by_shape.setdefault(tuple(meta["shape"]), []).append((source, list(meta["fingerprint"])))
        for name, param in self.params.items():
            if name in done or not param.is_floating_point():
                continue
            mine = fingerprint(param)  # in the engine's dtype: a bf16 copy of an fp32 tensor matches
            candidates = [
                s for s, theirs in by_shape.get(tuple(param.shape), []) if fingerprints_match(mine, theirs)
            ]
            if not candidates:
                continue
            source = max(candidates, key=lambda s: shared_tail(s, name))
            whole = [[0, dim] for dim in param.shape]
            rows = [[0, 0, param.shape[0]]] if param.dim() else None
            self.loads.append(Load(param=name, source=source, region=whole, rows=rows))


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[LoadRecord | None]:
    """Record ``model``'s weight load for the block: its ``load_weights`` and its parameters'
    ``weight_loader`` s wrapped, put back at the end whatever happens. Yields None (and records
    nothing) when the model has no ``load_weights``."""
    load_weights = vllm_compat.model_load_weights(model)
    if load_weights is None:
        yield None
        return
    record = LoadRecord(model)
    saved: list[tuple[nn.Parameter, Callable[..., Any]]] = []
    had_own = "load_weights" in model.__dict__
    try:
        for name, param in record.params.items():
            loader = vllm_compat.param_weight_loader(param)
            if loader is not None:
                vllm_compat.set_param_weight_loader(param, record.wrap(name, param, loader))
                saved.append((param, loader))

        @functools.wraps(load_weights)
        def tagged(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
            return load_weights(record.weights(weights), *args, **kwargs)

        model.load_weights = tagged  # type: ignore[method-assign]
        yield record
        record.find_plain_copies()
    finally:
        for param, loader in saved:
            vllm_compat.set_param_weight_loader(param, loader)
        if had_own:
            model.load_weights = load_weights  # type: ignore[method-assign]
        else:
            model.__dict__.pop("load_weights", None)

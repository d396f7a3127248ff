"""The noise model: what error upstream explains, judged by the numerical physics of the run.

Whether a router's flip is a near-tie is measured in :mod:`~tracedump.compare.measure.routing` (its margins
against its
scores' noise, ``TIE_FACTOR``); what that flip then means for the pair is decided here.

A fixed threshold per dtype cannot be right. Two bf16 runs of the same code agree *exactly* up to
a bug, and a one-layer bug then shows as an error of ~1e-4 (rel_diff) after exact zeros: far below
a bf16 threshold that must also pass bf16-vs-fp32 noise, which reaches ~1e-4 after a few layers
and keeps growing through a deep model. So each tensor is judged against what the error already
present *upstream* explains (rel_diff and 1 - cosine; both are squared relative errors):

    explained = G * L + R            (G = GROWTH, R = K_ROUNDING * (u_run^2 + n * u_acc^2))

- ``L`` is the running level: the largest error of the tensors before this one, in execution order,
  that were themselves explained; for a container's later output leaves (attention weights), the
  level before its last child started (:mod:`.containers`: recorded later is not computed later).
  Modules downstream of a noisy one inherit its noise, amplified by their conditioning (a softmax
  over logits of a few units, a residual with cancellation): ``G`` allows one op to amplify it
  100x in rel_diff (10x in RMS error).
- ``R`` is what one more op can add at the run precision: a few roundings of the output dtype
  (``u_run`` its unit roundoff: 2^-8 for bf16, 2^-24 for fp32) plus the fp32 accumulation over the
  tensor's last dim (``n``), which dominates fp32 runs. An error from exact zeros is a divergence
  when it exceeds a few roundings of one op: a kernel change in bf16 starts at ~0.4 u^2, a 2% MLP
  scale bug at ~13 u^2.
- Between runs at different precisions (bf16 against fp32) the model's inputs already differ by one
  rounding (u^2/3), so the level starts there instead of at exact zero.
- The per-dtype default (:mod:`.tolerance`) is a ceiling that the growth allowance never lifts: an
  error that jumps past it is a divergence, however noisy upstream. Errors carried in from earlier
  passes (a diffusion loop feeding its latents back, a KV cache) are upstream too; the ceiling is
  lifted only for a tensor whose own error neared it in an earlier pass, to ``CARRY_GROWTH`` x that
  error: a 25-step bf16 loop grows its errors step by step, not one module at once.

With ``--baseline C`` (the reference rerun under the difference the user accepts, e.g. in A's
dtype), each pair's threshold is its own measured noise instead: ``BASELINE_FACTOR * err(C, B) + R``
(``R`` is the floor where the noise is exactly zero), under the same ceiling, except past a near-tie
routing flip, where both runs are measured on the tokens their routers routed alike and a measured
noise is not overruled. The error is reported as "x noise".

A user ``--rtol`` (global, or a ``REGEX=VALUE`` rule matching the name) fixes that pair's threshold
instead; ``max_abs`` is an allclose test and keeps its fixed rule; integers compare exactly.
A near-tie MoE routing flip's effect joins the running level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...store.dtypes import UNIT_ROUNDOFF
from ..results import Measured
from .allowance import roundoffs

GROWTH = 100.0  # how much one op may amplify the upstream error (rel_diff, i.e. 10x in RMS)
CARRY_GROWTH = 10.0  # how much one step of a loop may grow a tensor's own error past the ceiling
K_ROUNDING = 3.0  # roundings one op may add, in units of u^2 (rel_diff of one rounding ~ u^2/3)
BASELINE_FACTOR = 10.0  # x the measured noise err(C, B) (about 3x in RMS error)
NOISE_MODEL = ("rel_diff", "cosine")  # metrics the noise model judges; the others keep fixed rules


def rounding_floor(precision: str | None, last_dim: int) -> float:
    """``R``: the error one op can add at ``precision`` (output rounding plus fp32 accumulation)."""
    u_run, u_acc = roundoffs(precision)
    return K_ROUNDING * (u_run**2 + max(last_dim, 1) * u_acc**2)


@dataclass(kw_only=True)
class Level:
    """The running error level of one root pair: this pass's, and what earlier passes carried."""

    pass_index: int | None = None
    in_pass: float = 0.0
    carried: float = 0.0
    flipped: float = 0.0  # this pass's error let through by near-tie routing flips
    own: dict[str, float] = field(default_factory=dict)  # each tensor's largest error in earlier passes
    this_pass: dict[str, float] = field(default_factory=dict)

    def enter(self, pass_index: int) -> None:
        if pass_index != self.pass_index:
            self.carried = max(self.carried, self.in_pass)
            for name, error in self.this_pass.items():
                self.own[name] = max(self.own.get(name, 0.0), error)
            self.in_pass, self.flipped, self.this_pass = 0.0, 0.0, {}
            self.pass_index = pass_index

    def absorb(self, name: str, error: float) -> None:
        self.in_pass = max(self.in_pass, error)
        self.this_pass[name] = max(self.this_pass.get(name, 0.0), error)

    def upstream(self, name: str, scope: tuple[float, str] | None) -> Upstream:
        """What the judge reads of this level for tensor ``name``; ``scope``: (the level, the name of
        the first tensor it leaves out) when less than the whole level explains it (a container's
        own output, :mod:`.containers`)."""
        return Upstream(
            in_pass=self.in_pass if scope is None else scope[0],
            carried=self.carried,
            own=self.own.get(name, 0.0),
            flipped=self.flipped,
            level_before=scope[1] if scope is not None else None,
        )


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """The error already present before a tensor, in its pass and root: the judge's evidence for
    the noise model."""

    in_pass: float  # the level of this pass that may explain it
    carried: float  # what earlier passes carried in
    own: float  # this tensor's own largest error in earlier passes
    flipped: float  # this pass's error let through by near-tie routing flips
    level_before: str | None = None  # a container's own output: the first tensor the level leaves out

    def cap(self, ceiling: float) -> float:
        """The ceiling, lifted only for a tensor whose own error already neared it in an earlier
        pass (a loop that feeds its output back grows each tensor's error step by step)."""
        return max(ceiling, CARRY_GROWTH * self.own)


NO_UPSTREAM = Upstream(in_pass=0.0, carried=0.0, own=0.0, flipped=0.0)


def explained(upstream: Upstream, floor: float, ceiling: float, inputs: float = 0.0) -> float:
    """What the upstream error explains: growth within the pass, and growth of what earlier passes
    carried in, both under the ceiling (see :meth:`Upstream.cap`). ``inputs`` is the error the
    model's inputs already carry."""
    within = min(GROWTH * max(upstream.in_pass, inputs) + floor, ceiling)
    carried = min(GROWTH * upstream.carried + floor, upstream.cap(ceiling))
    return max(within, carried)


def input_rounding(precision: str | None) -> float:
    """rel_diff of one rounding to ``precision`` (~u^2/3): what the inputs of two runs at different
    precisions differ by before any module runs (a prompt's embeddings, latents, timesteps)."""
    return UNIT_ROUNDOFF.get(precision or "float32", UNIT_ROUNDOFF["float32"]) ** 2 / 3


def last_dim(result: Measured) -> int:
    shape = result.shape_b or result.shape_a or ()
    return shape[-1] if shape else 1

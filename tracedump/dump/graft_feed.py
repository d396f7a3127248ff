"""How a grafted module's call takes the reference's inputs when its signature is not the reference's.

Grafting (:mod:`tracedump.dump.graft`) feeds each grafted module the inputs the reference dumped for
the module of the same name, input path by input path (``@in[0]`` to ``@in[0]``). An engine's
module can take the same values in another form. vLLM's decoder layer is called
``layer(positions, hidden_states, residual)``: the residual stream is ``hidden_states + residual``
(the residual add is deferred to the next fused add + norm), while HF's layer takes the whole
stream as its ``hidden_states`` (``@in[0]``). Fed by path, the layer's ``positions`` (``@in[0]``)
would meet HF's hidden states and nothing would be grafted; vLLM's ``RMSNorm(x, residual)`` would
take HF's whole stream as ``x`` and add its own residual to it, counting the residual twice.

An :class:`InputFeed` says, for one module, how its call is fed instead: which of its forward
parameters takes which of the reference's input paths (``hidden_states`` <- ``[0]``), which are
replaced by zeros (the deferred ``residual``: the reference's input already holds it, so
``x + 0`` is the stream, exactly, in any dtype, and the module keeps its own code path, the fused
add + norm included), and which keep this run's own values (``positions``). Or that the module
cannot be grafted, and why (``refuse``): each of its calls then runs on its own inputs and is
listed as not grafted with that reason.

An engine integration builds the feeds (the vLLM plugin: :mod:`tracedump.integrations.vllm_graft`)
and hands them over with the public :meth:`tracedump.Dumper.set_graft_feeds`; the
:class:`~tracedump.dump.grafter.Grafter` applies them (:func:`fed_paths`). No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import GraftFeedRefused

__all__ = ["KEPT", "ZERO", "InputFeed", "fed_paths"]

ZERO = "0"  # fed_paths: this input is replaced by zeros of its own shape, dtype and device
KEPT = "own"  # the manifest's graft.fed_inputs: this input kept the run's own value

_FIRST = re.compile(r"^\[([^\]]*)\](.*)$")


@dataclass(frozen=True, kw_only=True)
class InputFeed:
    """How one module's calls take the reference's inputs.

    ``params``: the module's forward parameters in positional order (a positional input ``[i]``
    is parameter ``params[i]``, a keyword input ``[name]`` parameter ``name``). ``take``: parameter
    -> the reference's input paths that hold its value, tried in order (``("[0]",
    "[hidden_states]")``: positional or by keyword in the reference's call). ``zero``: parameters
    replaced by zeros when the call passes a tensor (None stays None). Every other input keeps
    its own value. ``refuse``: the module cannot be grafted, and why. ``what``: one line for the
    manifest (``graft.feeds``)."""

    params: tuple[str, ...] = ()
    take: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    zero: frozenset[str] = frozenset()
    refuse: str | None = None
    what: str = ""

    def describe(self) -> str:
        """What the manifest says of this feed."""
        if self.refuse is not None:
            return f"refused: {self.refuse}"
        if self.what:
            return self.what
        taken = ", ".join(f"{p} <- reference {' or '.join(paths)}" for p, paths in self.take.items())
        zeroed = ", ".join(f"{p} <- 0" for p in sorted(self.zero))
        return "; ".join(part for part in (taken, zeroed) if part)


def _parameter(path: str, params: tuple[str, ...]) -> tuple[str, str]:
    """``(parameter, rest)`` of an input path: ``[1][0]`` -> ``(params[1], "[0]")``."""
    found = _FIRST.match(path)
    if found is None:
        return path, ""
    key, rest = found.group(1), found.group(2)
    if key.isdigit() and int(key) < len(params):
        return params[int(key)], rest
    return key, rest


def fed_paths(feed: InputFeed, own: Iterable[str], dumped: set[str]) -> tuple[dict[str, str], list[str]]:
    """For a call whose tensor inputs are at ``own`` (paths as a key spells them, ``[1]``), with
    the reference's inputs at ``dumped``: ``(own path -> reference path, or ZERO)`` and the own
    paths kept as they are. Raises :class:`GraftFeedRefused` (the reason) when the module is refused,
    when an input to take has no reference tensor, or when nothing would be taken."""
    if feed.refuse is not None:
        raise GraftFeedRefused(feed.refuse)
    fed: dict[str, str] = {}
    kept: list[str] = []
    for path in own:
        param, rest = _parameter(path, feed.params)
        if param in feed.zero:
            fed[path] = ZERO
        elif param in feed.take:
            candidates = [alt + rest for alt in feed.take[param]]
            found = next((c for c in candidates if c in dumped), None)
            if found is None:
                listed = ", ".join(sorted(dumped)) or "none"
                raise GraftFeedRefused(
                    f"input {param} ({path}) takes the reference's {' or '.join(candidates)}, which it "
                    f"did not dump (it dumped: {listed})"
                )
            fed[path] = found
        else:
            kept.append(path)
    if not any(source != ZERO for source in fed.values()):
        wanted = ", ".join(feed.take) or "none"
        raise GraftFeedRefused(f"no input of this call is one the feed takes from the reference ({wanted})")
    return fed, kept

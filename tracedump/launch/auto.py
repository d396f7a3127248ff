"""Auto-attach: dump every *root* module of a process whose code never mentions tracedump.

The bootstrap (``sitecustomize``) calls :func:`install` once ``torch`` is imported. ``install`` reads
the settings from the env (a bad value is reported once and leaves the process undisturbed) and
registers one global forward pre-hook and one global forward hook, which keep a per-thread count of
module forwards in progress. A module whose forward starts while that count is 0 is a **root**. At a
root's first call a :class:`~tracedump.Dumper` is attached to it, exactly as ``attach(root)`` would
(same selection, same keys, one pass per root forward), so dumps from an integrated engine and from
``tracedump run`` compare directly.

Root labels: the class name of the root (``LlamaForCausalLM``); a second distinct instance of the
same class called as a root gets ``LlamaForCausalLM#2``, then ``#3``, in order of first call. The
label is the manifest's ``"root"``; the first dumper of a process writes ``rank<R>_pid<P>/``, later
ones ``rank<R>_pid<P>-2/``, ``-3/`` in order of first call too.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..config.settings import DumpSettings, load_settings
from ..config.switch import DEFAULT_ENV_PREFIX, is_enabled
from ..dump.dumper import Dumper, original_module
from ..dump.hooks import RootPassHooks, forward_calls_on_stack, forward_kwargs_on_stack, traced_by_dynamo
from ..dump.runtime import runtime, warn_once
from ..dump.torch_compat import forward_pre_hooks, forward_pre_hooks_with_kwargs, frame_self, stack_frame
from ..errors import ConfigError

_installed: AutoAttach | None = None


@dataclass
class _Root:
    """A module seen as a root: its label and its dumper (None when it is dumped some other way)."""

    module: weakref.ref[nn.Module]
    label: str
    dumper: Dumper | None


def install(env_prefix: str = DEFAULT_ENV_PREFIX) -> AutoAttach | None:
    """Register the global hooks, once per process, if ``<prefix>DUMP_DIR`` is set and the settings
    are valid. Returns the :class:`AutoAttach`, or None when dumping is off or misconfigured."""
    global _installed
    if _installed is not None:
        return _installed
    if not is_enabled(None, env_prefix):
        return None
    try:
        settings = load_settings(None, env_prefix)
        if settings.enabled:
            settings.resolve_callables()  # FILTER_FN, SYNC_ESCAPE: imported once, for every root
    except ConfigError as error:
        print(f"{error}\ntracedump: nothing is dumped in pid {os.getpid()}.", file=sys.stderr)
        return None
    if not settings.enabled:
        return None
    _installed = AutoAttach(settings, env_prefix)
    _installed.register()
    return _installed


def installed() -> AutoAttach | None:
    """The :class:`AutoAttach` that :func:`install` registered in this process, None when none is
    (dumping off, misconfigured, or ``install`` never called): what the vLLM plugin asks before it
    removes the launcher's global hooks."""
    return _installed


class AutoAttach:
    """Global module hooks that find roots and give each one a dumper at its first call."""

    def __init__(self, settings: DumpSettings, env_prefix: str = DEFAULT_ENV_PREFIX) -> None:
        self.settings = settings
        self.env_prefix = env_prefix
        self._local = threading.local()
        self._lock = threading.Lock()
        self._roots: dict[int, _Root] = {}
        self._member_ids: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self._label_counts: collections.Counter[str] = collections.Counter()
        self._handles: list[Any] = []
        # Whether torch runs a pre-hook that a global pre-hook registered on the same call: it does
        # not today (it snapshots the hooks first), so the first call's pre-hooks are replayed.
        self._late_hooks_fire = _late_pre_hooks_fire()
        runtime().on_fork_in_child(self._after_fork_in_child)

    # ------------------------------------------------------------------ public

    def register(self) -> None:
        self._handles = [
            torch_module.register_module_forward_pre_hook(self._before),
            torch_module.register_module_forward_hook(self._after, always_call=True),
        ]

    def remove(self) -> None:
        """Remove the global hooks and close every dumper made here (tests, or a host that is done)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.close_dumpers()

    @property
    def roots(self) -> dict[str, Dumper | None]:
        """Label -> dumper of every root seen so far, in order of first call."""
        return {root.label: root.dumper for root in self._roots.values()}

    def close_dumpers(self) -> None:
        """Flush and close every dumper made here (safe twice; a dumper inherited over fork and
        never used in this process writes nothing)."""
        for root in list(self._roots.values()):
            if root.dumper is not None:
                root.dumper.close()

    # ------------------------------------------------------------------ global hooks

    def _before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # a traced forward: stay out of Dynamo's graph
            traced_by_dynamo()  # ... but say that its calls go undumped
            return
        depth = getattr(self._local, "depth", 0)
        if depth and self._left_behind(module):
            depth = 0  # a BaseException unwound the last root forward without its post-hooks
        self._local.depth = depth + 1
        if depth == 0:
            self._local.root = module
            try:
                self._on_root_call(module, args)
            except Exception as error:  # never break the host's forward
                warn_once(
                    "auto_attach_error",
                    f"tracedump: auto-attach failed at {type(module).__name__}: "
                    f"{type(error).__name__}: {error}. The program continues.",
                )

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._local.depth = max(getattr(self._local, "depth", 1) - 1, 0)

    def _left_behind(self, module: nn.Module) -> bool:
        """Whether the depth count is stale. A module inside the running root's tree is a nested call
        (a set lookup); anything else is checked against the stack."""
        root = getattr(self._local, "root", None)
        if root is None:
            return False
        if module is not root and id(module) in self._members(root):
            return False
        return forward_calls_on_stack(root) <= (1 if module is root else 0)

    def _members(self, root: nn.Module) -> set[int]:
        members = self._member_ids.get(root)
        if members is None:
            members = self._member_ids[root] = {id(m) for m in root.modules()}
        return members

    # ------------------------------------------------------------------ roots

    def _on_root_call(self, module: nn.Module, args: Any) -> None:
        target = original_module(module)
        if self._known(target) or self._inside_known_root(target):
            return
        owner = _calling_model(target)
        with self._lock:
            if self._known(target) or (owner is not None and self._known(owner)):  # another thread
                return
            root = self._new_root(owner, owner) if owner is not None else self._new_root(module, target)
        if root.dumper is not None and target is module and not self._late_hooks_fire:
            _replay_pre_hooks(root.dumper, module, args)

    def _inside_known_root(self, target: nn.Module) -> bool:
        """A part of a root already dumped, called on its own (``generate()`` runs the encoder of an
        encoder-decoder model by itself): not a new root. The root's dumper, whose hooks are
        already on it, puts its captures into the pass of the root's next forward, under their
        full names (``encoder.block.0``)."""
        for root in list(self._roots.values()):
            module = root.module()
            if root.dumper is not None and module is not None and id(target) in self._members(module):
                return True
        return False

    def _known(self, target: nn.Module) -> bool:
        root = self._roots.get(id(target))
        return root is not None and root.module() is target

    def _new_root(self, module: nn.Module, target: nn.Module) -> _Root:
        label = self._next_label(target)
        dumper = None if _attached_explicitly(target) else self._attach(module, label)
        key = id(target)
        root = _Root(weakref.ref(target, lambda _ref: self._roots.pop(key, None)), label, dumper)
        self._roots[key] = root
        return root

    def _next_label(self, target: nn.Module) -> str:
        name = type(target).__name__
        self._label_counts[name] += 1
        count = self._label_counts[name]
        return name if count == 1 else f"{name}#{count}"

    def _attach(self, module: nn.Module, label: str) -> Dumper | None:
        if original_module(module) is not module:
            warn_once(
                "auto_compiled_root",
                f"tracedump run: the root {label} is torch.compile'd, and a compiled graph does not "
                "run forward hooks: expect missing captures. Re-run with `tracedump run --no-compile` "
                "(TORCHDYNAMO_DISABLE=1) or the engine's eager flag.",
            )
        try:
            return Dumper(
                original_module(module), self.settings, env_prefix=self.env_prefix, root_label=label
            )
        except Exception as error:
            warn_once(
                f"auto_attach_{label}",
                f"tracedump: cannot dump root {label}: {type(error).__name__}: {error}",
            )
            return None

    # ------------------------------------------------------------------ processes

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent may have held it while forking


_MAX_CALLER_FRAMES = 40


def _calling_model(target: nn.Module) -> nn.Module | None:
    """The model whose own method called ``target`` outside its forward, if any.

    ``generate()`` runs a T5's encoder, ``vae.decode()`` a VAE's ``post_quant_conv`` and
    ``decoder``, without the model's forward: the root is that model (``AutoencoderKL``, keys
    ``decoder.up_blocks...``), not each part as a root of its own, which would name them by class
    (``Decoder``) and split one model over several roots. Found by looking up the stack for the
    nearest method of a module that holds ``target`` (not its own ``torch.compile`` wrapper);
    walked only at a new root's first call."""
    frame = stack_frame(2)
    for _ in range(_MAX_CALLER_FRAMES):
        if frame is None:
            return None
        owner = frame_self(frame)
        if isinstance(owner, nn.Module) and original_module(owner) is not target and _holds(owner, target):
            return owner
        frame = frame.f_back
    return None


def _holds(owner: nn.Module, target: nn.Module) -> bool:
    return any(part is target for part in owner.modules())


def _attached_explicitly(module: nn.Module) -> bool:
    """An integrated engine already called ``attach()`` on this module: leave it to that dumper."""
    hooks = forward_pre_hooks(module).values()
    return any(isinstance(getattr(hook, "__self__", None), RootPassHooks) for hook in hooks)


def _replay_pre_hooks(dumper: Dumper, module: nn.Module, args: Any) -> None:
    """Run, for this one call, the pre-hooks the new dumper put on ``module`` (the pass opener, and
    the input capture when ``INPUTS=1``): torch chose the call's pre-hooks before ours ran.

    A global pre-hook sees no keyword arguments: those of the call are read from its frame, so an
    HF model's ``generate`` (all keywords) has its first pass's batch layout and input captures.
    """
    hooks = forward_pre_hooks(module)
    with_kwargs = forward_pre_hooks_with_kwargs(module)
    kwargs: dict[str, Any] | None = None
    for handle in dumper.hooks.handles:
        if handle.hooks_dict_ref() is not hooks or handle.id not in hooks:
            continue
        hook = hooks[handle.id]
        if handle.id in with_kwargs:
            if kwargs is None:
                kwargs = forward_kwargs_on_stack(module)
            hook(module, args, kwargs)
        else:
            hook(module, args)


def _late_pre_hooks_fire() -> bool:
    """Probe this torch: does a pre-hook registered by a global pre-hook run on that same call?"""
    probe = nn.Identity()
    fired: list[bool] = []

    def register_late(module: nn.Module, args: Any) -> None:
        if module is probe and not forward_pre_hooks(probe):
            probe.register_forward_pre_hook(lambda *_: fired.append(True))

    handle = torch_module.register_module_forward_pre_hook(register_late)
    try:
        probe(torch.zeros(()))
    finally:
        handle.remove()
    return bool(fired)

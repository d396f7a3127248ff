"""Forward hooks in C for bench_vllm's native layers (issue 35; the hooks: ``native_hooks.c``).

Why: the Python hook a dump runs per module costs ~4-5x its tight-loop time inside an engine's
forward, and no Python variant of it got much below a bare clone-and-append hook. What a hook
with no Python frame would cost is measured, not guessed: the same work in C, swapped in for the
round. These hooks are measuring tools, not part of the package: they are built at the first use
with the machine's C compiler into a temporary directory, and where there is none (or no Python
headers, or the build fails) the native layers are left out of the bench.
"""

from __future__ import annotations

import functools
import importlib.util
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

SOURCE = Path(__file__).with_name("native_hooks.c")

# The layers these hooks add to bench_vllm (its LAYERS): ``held_native`` is ``held`` with the
# clone-and-keep hook in C; ``held_steps`` the same hooks beside tracedump's per-step work (the
# dumper attached, its capture hooks out): the least a dumper that opens a pass per step and
# copies by forward hooks costs; ``native`` the real dump with each plain capture hook done in C
# (``Capture``: the recorder's plain full-mode path, into the same pass, with the same keys).
LAYERS = ("held_native", "held_steps", "native")


@functools.cache
def load() -> ModuleType | None:
    """The compiled hooks, or None where they cannot be built here (why: on stderr, once)."""
    include = sysconfig.get_paths()["include"]
    compiler = _compiler()
    if compiler is None or not Path(include, "Python.h").is_file():
        return _left_out(f"no C compiler or Python headers (CC, cc, gcc, clang; {include})")
    out = Path(tempfile.mkdtemp(prefix="tracedump-native-hooks-"))
    try:
        built = out / f"native_hooks{sysconfig.get_config_var('EXT_SUFFIX')}"
        command = [*compiler, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
        if done.returncode != 0:
            return _left_out(f"the build failed: {done.stderr[-2000:]}")
        spec = importlib.util.spec_from_file_location("native_hooks", built)
        if spec is None or spec.loader is None:
            return _left_out(f"{built} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module  # loaded: the mapping outlives the file
    except (OSError, ImportError, subprocess.SubprocessError) as e:
        return _left_out(f"the build or its import failed ({e!r})")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _compiler() -> list[str] | None:
    """The interpreter's own C compiler (sysconfig's CC), else the first of cc, gcc, clang found."""
    recorded = shlex.split(sysconfig.get_config_var("CC") or "")
    for command in ([recorded] if recorded else []) + [["cc"], ["gcc"], ["clang"]]:
        if shutil.which(command[0]) is not None:
            return command
    return None


def _left_out(why: str) -> None:
    print(f"benchmarks.native: {why}; the native layers are left out", file=sys.stderr)
    return None


def keeper(kept: list[Any]) -> Any:
    """A forward hook in C that clones each output tensor (one level of tuple) into ``kept``."""
    native = load()
    assert native is not None
    return native.Keeper(kept)


def swap_in_captures(dumper: Any, model: Any) -> int:
    """Replace each plain capture hook of ``dumper`` on ``model`` (an ``OutputHook``; the shared
    modules' hooks, which name each call after its caller, stay) by its C counterpart, in place in
    the module's hook dict: the order of the hooks and their handles are kept, so the dumper's
    removal removes them. Returns how many were swapped.

    The C hook repeats the recorder's tests that change while a dump runs and hands every case it
    does not take to the recorder; what is fixed for a dump it does not test, so it is checked
    here: a full-mode dump with no gate, on a process where CUDA is not in use (no graph capture to
    look for), writing through the file sink."""
    import torch

    from tracedump.dump.hooks import OutputHook
    from tracedump.dump.sinks import FileSink

    native = load()
    assert native is not None
    recorder = dumper.recorder
    plain = (
        recorder.mode == "full"
        and recorder._gateless
        and type(recorder.sink) is FileSink
        and not torch.cuda.is_initialized()
    )
    if not plain:
        raise ValueError("the native capture measures a full-mode dump with no gate, on the CPU, to files")
    swapped = 0
    for module in model.modules():
        hooks = module._forward_hooks
        for hook_id, hook in list(hooks.items()):
            if type(hook) is OutputHook and hook.then is None and hook.target is recorder:
                hooks[hook_id] = native.Capture(hook.name, recorder, dumper.rundir)
                swapped += 1
    return swapped

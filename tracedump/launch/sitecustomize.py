"""tracedump's bootstrap: ``tracedump run`` puts this folder first on ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up, so every Python process started under ``tracedump run``
(and, since ``PYTHONPATH`` is inherited, every child it spawns) runs this file before its own code.
It does three things, in this order:

1. takes its own folder off ``sys.path`` again, so nothing else here can shadow a user's module;
2. runs the ``sitecustomize`` that Python would have found without us (a venv's or a distro's), so
   ``tracedump run`` never changes what the program saw before;
3. only if ``TRACEDUMP_DUMP_DIR`` is set: waits for ``torch`` to be imported, then hands over to
   :mod:`tracedump.launch.auto`, which hooks every root module at its first call.

Off (no ``TRACEDUMP_DUMP_DIR``): one env lookup after step 2, and nothing registered. On, a process
that never imports ``torch`` pays one entry on ``sys.meta_path`` (one string comparison per import)
and nothing more; tracedump itself is imported only once ``torch`` is.

Only ``os`` and ``sys`` are imported at module level: this file runs in *every* Python process. It
acts only when imported under the name ``sitecustomize``; importing it as
``tracedump.launch.sitecustomize`` does nothing.
"""

import os
import sys

_DIR_VAR = "TRACEDUMP_DUMP_DIR"
_NAME = "sitecustomize"


def _same_dir(entry: str, folder: str) -> bool:
    try:
        return os.path.normcase(os.path.abspath(entry or os.curdir)) == folder
    except (TypeError, ValueError):
        return False


def _drop_own_dir(folder: str) -> list:
    """Remove every ``sys.path`` entry that is this folder; return the remaining search path."""
    sys.path[:] = [entry for entry in sys.path if not _same_dir(entry, folder)]
    return list(sys.path)


def _run_previous_sitecustomize(search_path: list) -> None:
    """Execute the ``sitecustomize`` found on the path without us, as Python itself would have.

    It becomes ``sys.modules["sitecustomize"]``, so code that imports it by name still gets the
    user's module. An error in it is reported the way ``site`` reports one and start-up continues.
    """
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec(_NAME, search_path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # mirror site.py: report it and keep starting up
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:", file=sys.stderr)
        print(f"{type(error).__name__}: {error}", file=sys.stderr)


def _hand_over() -> None:
    """``torch`` is importable now: let :mod:`tracedump.launch.auto` register its global hooks.

    Never lets an error escape into the user's ``import torch``: dumping is a diagnostic.
    """
    try:
        from tracedump.launch.auto import install

        install()
    except Exception as error:  # dumping is a diagnostic: never fail the import
        print(
            f"tracedump: auto-attach disabled in pid {os.getpid()}: {type(error).__name__}: {error}",
            file=sys.stderr,
        )


class _LoaderThatReports:
    """Wraps torch's loader for one ``exec_module`` call, then calls :func:`_hand_over`.

    Before torch's own code runs, the module's ``__loader__`` and ``__spec__.loader`` are set back to
    the real loader, so nothing of this wrapper is visible afterwards.
    """

    def __init__(self, loader: object, watcher: object) -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if self._watcher in sys.meta_path:
            sys.meta_path.remove(self._watcher)
            _hand_over()

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


class _TorchImportWatcher:
    """A ``sys.meta_path`` finder that answers only for ``torch``: it asks the other finders for
    torch's real spec and wraps its loader. Every other import goes past it (one string comparison).

    It leaves ``meta_path`` only once torch has actually been executed: libraries probe with
    ``importlib.util.find_spec("torch")`` long before they import it (transformers does), and a
    probe must not use the watcher up.
    """

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != "torch" or "torch" in sys.modules:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderThatReports(spec.loader, self)
                return spec
        return None

    def __repr__(self) -> str:
        return "tracedump._TorchImportWatcher()"


def _arm() -> None:
    if "torch" in sys.modules:  # a previous sitecustomize imported it already
        _hand_over()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())


def _bootstrap() -> None:
    folder = os.path.normcase(os.path.dirname(os.path.abspath(__file__)))
    _run_previous_sitecustomize(_drop_own_dir(folder))
    if os.environ.get(_DIR_VAR, "").strip():
        _arm()


if __name__ == _NAME:
    _bootstrap()

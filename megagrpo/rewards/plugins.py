"""Loading reward plugins named in a config, and the rule for what a config may construct.

A config may name a reward by:

* a megagrpo registry name (``mcq_accuracy``, ``soft_overlong``; :mod:`.registry`);
* an import path ``'module.path:Name'`` (the module must be importable: on ``PYTHONPATH``,
  or loaded from a file listed in ``rewards.external_plugins``, which is executed from its
  own path); a module of the standard library or any ``__main__`` module is refused before
  anything is imported (located with ``importlib.util.find_spec``);
* an ms-swift ``orms`` registry name ``'orms:<name>'``: a built-in of ms-swift
  (``orms:accuracy`` is ms-swift's ``MathAccuracy``) or a name a plugin file registered with
  ``orms['name'] = Class`` (ms-swift's ``--external_plugins plugin.py --reward_funcs name``).

Configs are code-trusted like a Python file: importing a plugin module runs it. What a
config cannot do is make megagrpo *construct or call* an arbitrary object with config
values (``subprocess:Popen`` with ``{args: ..., shell: true}`` ran a command; ``os:system``
would run every completion as a shell command). So before anything named in a config is
constructed or called, :func:`check_reward_object` requires it to be a reward:

1. it is a Python class, a Python function (``def``/``async def``) or an instance of a
   Python class; builtins (``os:system``), modules, methods, ``functools.partial`` are not;
2. and one of:

   a. a subclass of ms-swift's ``ORM`` / ``AsyncORM`` (``swift.rewards.orm``), wherever it
      is defined (ms-swift's own ``SoftOverlong``, a pip-installed plugin package);
   b. marked with :func:`reward_plugin` (``@megagrpo.rewards.reward_plugin``), for plugin
      packages that do not depend on ms-swift;
   c. defined in the user's own code: a module that is not in the standard library, not a
      builtin, not inside ``site-packages``/``dist-packages`` and not megagrpo itself;

3. and (b, c) it has the ORM call shape ``(completions, **kwargs)``: a first positional
   parameter and a ``**kwargs`` (ms-swift calls every reward as ``f(completions,
   **columns)``); for a class, its own ``__call__`` (not ``object``'s) has that shape.

So stdlib and third-party callables are rejected by (2) before any construction, whatever
their signature, and a user's function cannot be confused with a shell runner by (3).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError

_ORM_BASES = {
    ("swift.rewards.orm", "ORM"),
    ("swift.rewards.orm", "AsyncORM"),
    ("swift.plugin.orm", "ORM"),  # ms-swift 3.x
    ("swift.plugin.orm", "AsyncORM"),
}
MARKER = "__megagrpo_reward_plugin__"
ORMS_PREFIX = "orms:"


def reward_plugin(obj: Any) -> Any:
    """Decorator marking a function or class in an installed package as a reward plugin
    (rule 2b of the module docstring)."""
    setattr(obj, MARKER, True)
    return obj


@contextlib.contextmanager
def preserved_logging() -> Iterator[None]:
    """Put the logging configuration back as it was after plugin code ran: importing
    ``swift.rewards`` sets the root handlers' level to ERROR (ms-swift's logger setup), which
    silenced every later megagrpo INFO/WARNING line. Restored: the root logger's level and
    handlers (and their levels), ``logging.disable``, and megagrpo's loggers."""
    root = logging.getLogger()
    manager = logging.Logger.manager
    handlers = [(h, h.level) for h in root.handlers]
    mine = {
        name: (lg.level, lg.disabled, lg.propagate)
        for name, lg in manager.loggerDict.items()
        if isinstance(lg, logging.Logger) and (name == "megagrpo" or name.startswith("megagrpo."))
    }
    saved = (root.level, manager.disable)
    try:
        yield
    finally:
        root.setLevel(saved[0])
        logging.disable(saved[1])
        root.handlers[:] = [h for h, _ in handlers]
        for h, level in handlers:
            h.setLevel(level)
        for name, (level, disabled, propagate) in mine.items():
            lg = logging.getLogger(name)
            lg.setLevel(level)
            lg.disabled, lg.propagate = disabled, propagate


def _import(module_name: str, what: str) -> Any:
    """Import ``module_name`` (the logging configuration preserved); any failure becomes a
    ConfigError naming ``what``."""
    try:
        with preserved_logging():
            return importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        hint = (
            " (install the swift extra: pip install 'megagrpo[swift]')"
            if missing == "swift" or missing.startswith("swift.")
            else ""
        )
        raise ConfigError(f"{what}: cannot import {module_name}: {exc}{hint}") from exc
    except BaseException as exc:  # noqa: BLE001 - a plugin's import may raise anything
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConfigError(
            f"{what}: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc


def _exec_file(name: str, path: Path, where: str) -> None:
    """Load ``path`` as module ``name`` from that file (never another module of that name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with preserved_logging():  # ms-swift's imports raise the root level to ERROR
            spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - a plugin's import may raise anything
        sys.modules.pop(name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        hint = (
            " (install the swift extra: pip install 'megagrpo[swift]')"
            if isinstance(exc, ImportError) and (getattr(exc, "name", "") or "").startswith("swift")
            else ""
        )
        raise ConfigError(
            f"{where}: importing {path} raised {type(exc).__name__}: {exc}{hint}"
        ) from exc


def load_external_plugins(paths: Iterable[str], key: str = "rewards.external_plugins") -> None:
    """Load plugin files (ms-swift's ``--external_plugins``): each file is executed from its
    own path as a module named after its stem (its directory goes on ``sys.path`` for its own
    imports), so its classes are then reachable as ``'<stem>:ClassName'`` and its
    ``orms[...]`` registrations as ``'orms:<name>'``. A stem that is not an identifier or
    that names a standard-library module is refused (it would shadow it). ConfigError naming
    the file on any failure."""
    for i, raw in enumerate(paths):
        path = Path(raw).expanduser().resolve()
        where = f"config key '{key}.{i}' ({raw})"
        if not path.is_file() or path.suffix != ".py":
            raise ConfigError(f"{where}: not a Python file")
        name = path.stem
        if not name.isidentifier() or name in sys.stdlib_module_names or name == "__main__":
            raise ConfigError(
                f"{where}: a plugin file must be named <identifier>.py and not after a "
                f"standard-library module ('{name}'); rename the plugin file"
            )
        loaded = sys.modules.get(name)
        if loaded is not None:
            origin = getattr(loaded, "__file__", None)
            if origin and Path(origin).resolve() == path:
                continue
            raise ConfigError(
                f"{where}: a module named '{name}' is already imported from {origin}; "
                "rename the plugin file"
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        _exec_file(name, path, where)


def _refuse_before_import(module_name: str, what: str) -> None:
    """ConfigError, before anything is imported, for a reward module that is (in) a
    ``__main__`` module or lives in the standard library: importing either can run a
    program (``venv.__main__`` creates a virtualenv), and neither holds a reward. The module
    is located with ``importlib.util.find_spec`` on its top-level package (which imports
    nothing)."""
    parts = module_name.split(".")
    if "__main__" in parts or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{what}: '{module_name}' is not a module a reward can come from")
    top = parts[0]
    stdlib = top in sys.stdlib_module_names or top in sys.builtin_module_names
    if not stdlib and top not in sys.modules:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"{what}: cannot import {module_name}: {exc}") from exc
        if spec is None:
            raise ConfigError(f"{what}: cannot import {module_name}: no module named '{top}'")
        origin = Path(spec.origin).resolve() if spec.origin and spec.has_location else None
        site = origin is not None and any(
            p in ("site-packages", "dist-packages") for p in origin.parts
        )
        stdlib = (
            origin is not None
            and not site
            and any(origin.is_relative_to(d) for d in _stdlib_dirs())
        )
    if stdlib:
        raise ConfigError(
            f"{what}: '{module_name}' is in the standard library: a reward must come from a "
            "plugin file, your own module or an installed reward package (not imported)"
        )


def load_object(path: str) -> Any:
    """The object named by ``'module.path:Name'`` or ``'orms:<name>'`` (not yet checked)."""
    if path.startswith(ORMS_PREFIX):
        key = path[len(ORMS_PREFIX) :]
        registry = getattr(_import("swift.rewards", f"reward '{path}'"), "orms", None)
        if not isinstance(registry, dict):
            raise ConfigError(f"reward '{path}': swift.rewards has no 'orms' registry")
        if key not in registry:
            raise ConfigError(
                f"reward '{path}': '{key}' is not in ms-swift's orms registry (known: "
                f"{', '.join(sorted(registry))}); list the file that registers it in "
                "rewards.external_plugins"
            )
        return registry[key]
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward '{path}': expected 'module.path:ClassName' or 'orms:<name>'")
    _refuse_before_import(module_name, f"reward '{path}'")
    obj = _import(module_name, f"reward '{path}'")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward '{path}': {module_name} has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def _stdlib_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if k in paths]


def code_origin(obj: Any) -> str:
    """Where ``obj``'s code lives: ``builtin`` | ``stdlib`` | ``site`` | ``megagrpo`` | ``user``."""
    module_name = getattr(obj, "__module__", None) or ""
    top = module_name.split(".")[0]
    if not top or top == "builtins" or top in sys.builtin_module_names:
        return "builtin"
    if top in sys.stdlib_module_names:
        return "stdlib"
    if top == "megagrpo":
        return "megagrpo"
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return "builtin"
    resolved = Path(file).resolve()
    if any(part in ("site-packages", "dist-packages") for part in resolved.parts):
        return "site"
    if any(resolved.is_relative_to(d) for d in _stdlib_dirs()):
        return "stdlib"
    return "user"


def is_swift_orm_class(cls: type) -> bool:
    """A proper subclass of ms-swift's ``ORM``/``AsyncORM``."""
    return any((c.__module__, c.__qualname__) in _ORM_BASES for c in cls.__mro__[1:])


def _has_orm_shape(fn: Any, bound: bool) -> bool:
    """``fn`` takes a first positional argument (after ``self`` when unbound) and **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if not bound:
        params = params[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first_ok = bool(params) and (
        params[0].kind in positional or params[0].kind is inspect.Parameter.VAR_POSITIONAL
    )
    return first_ok and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_reward_object(obj: Any, name: str) -> None:
    """ConfigError unless ``obj`` may be constructed/called as a reward (module docstring)."""
    is_class = inspect.isclass(obj)
    is_function = inspect.isfunction(obj)
    cls = obj if is_class else type(obj)
    if not (is_class or is_function) and (
        inspect.isbuiltin(obj)
        or inspect.ismodule(obj)
        or inspect.ismethod(obj)
        or inspect.isroutine(obj)
        or not callable(obj)
        or code_origin(cls) in ("builtin", "stdlib")
    ):
        raise ConfigError(
            f"reward '{name}': {obj!r} is not a Python class or function usable as a reward"
        )
    if (is_class or not is_function) and is_swift_orm_class(cls):
        return
    target = obj if is_function else cls
    origin = code_origin(target)
    marked = getattr(obj, MARKER, False) or getattr(cls, MARKER, False)
    if not marked and origin != "user":
        raise ConfigError(
            f"reward '{name}': refusing to construct or call "
            f"{getattr(target, '__qualname__', obj)!r}"
            f" from {origin} code ({getattr(target, '__module__', '?')}): a reward named in a "
            "config must subclass ms-swift's ORM, be marked with @megagrpo.rewards."
            "reward_plugin, or be defined in your own module (not the standard library or "
            "site-packages)"
        )
    if is_function:
        ok = _has_orm_shape(obj, bound=True)
    else:
        call = next(
            (
                c.__dict__["__call__"]
                for c in cls.__mro__
                if c is not object and "__call__" in c.__dict__
            ),
            None,
        )
        ok = call is not None and _has_orm_shape(call, bound=False)
    if not ok:
        raise ConfigError(
            f"reward '{name}': {getattr(target, '__qualname__', obj)!r} does not have the ORM "
            "call shape: a function f(completions, **kwargs) or a class whose __call__(self, "
            "completions, **kwargs) returns one float per completion"
        )

"""Plug-ins: a function of your own, named on the command line as MODULE:FUNCTION.

    --trainer docs/examples/flat_allreduce_trainer.py:make_trainer     (verify: refimpl/tools/verification.py)
    --schedule docs/examples/my_schedule.py:early_backward             (train, verify, schedule:
                                                                        refimpl/parallel/pipeline/schedules)
    --schedule my_package.schedules:my_schedule

MODULE is either a path to a .py file (loaded from that file, whatever the working directory's
packages) or a dotted module name, imported as `python -m` would: from the working directory
first, then PYTHONPATH and the installed packages. Every failure is one ValueError line that names
the flag and the spec: a malformed spec, a missing file, an import that fails (with its exception),
a missing or non-callable attribute. What the function must accept and return is the caller's to
check. This module imports only the standard library, so any layer of refimpl may use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

_FILES: dict = {}  # (resolved path, mtime_ns) -> module: a file is executed once, not per lookup


def is_spec(text) -> bool:
    """Whether `text` names a plug-in (MODULE:FUNCTION) rather than a built-in name."""
    return isinstance(text, str) and ":" in text


def _module_from_file(path: Path, flag: str, spec: str):
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _FILES:
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{flag} {spec!r}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _FILES[key] = module
    return _FILES[key]


def load_function(spec: str, flag: str, example: str):
    """FUNCTION from 'package.module:FUNCTION' or 'path/to/file.py:FUNCTION' (one clear line otherwise).

    `flag` ('--trainer', '--schedule') starts every message; `example` is a spec that works, shown
    when `spec` is malformed.
    """
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"{flag} {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION, e.g. {example}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"{flag} {spec!r}: no file {module_name}")
            module = _module_from_file(path, flag, spec)
        else:
            if "" not in sys.path and "." not in sys.path:
                sys.path.insert(0, ".")  # a module in the working directory, as `python -m` would find it
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see, in one line
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name}: {type(exc).__name__}: {message}") from None
    if not hasattr(module, function):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no function {function!r}")
    found = getattr(module, function)
    if not callable(found):
        shown = repr(found) if len(repr(found)) <= 40 else repr(found)[:37] + "..."
        raise ValueError(f"{flag} {spec!r}: {function!r} in {module_name} is not a function: it is "
                         f"{type(found).__name__} {shown}")
    return found


__all__ = ["is_spec", "load_function"]

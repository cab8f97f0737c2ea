"""Model specs on the command line: `package.module:factory` or `path/to/file.py:factory`.

The factory takes no argument and returns `(model, example_inputs)` or
`(model, example_inputs, example_kwargs)`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.nn as nn

from pdcompile.core.errors import SpecError
from pdcompile.core.regular_file import open_regular


@dataclass(frozen=True)
class ModelSpec:
    """A model with the example call it is captured with."""

    model: nn.Module
    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any] = field(default_factory=dict)


def import_user_module(location: str, what: str) -> ModuleType:
    """Import a user's module, a dotted name or a path to a .py file (this runs its code);
    `what` names it in errors, e.g. "model spec 'm.py:f'". A file is imported once per path.

    Raises:
        SpecError: the module or file is missing, or raised while importing (named with the
            exception).
    """
    if location.endswith(".py") or os.sep in location or "/" in location:
        path = os.path.abspath(location)
        try:
            os.close(open_regular(path))  # a FIFO would block the import
        except FileNotFoundError:
            raise SpecError(f"{what}: no such file {location!r}") from None
        except OSError as e:
            raise SpecError(f"{what}: {location!r}: {e.strerror or e}") from None
        digest = hashlib.sha1(path.encode()).hexdigest()[:8]
        name = f"_pdcompile_user_{Path(path).stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise SpecError(f"{what}: {location!r} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise SpecError(f"{what}: importing {location!r} raised {e!r}") from e
        return module
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as e:
        if e.name and (location == e.name or location.startswith(f"{e.name}.")):
            raise SpecError(
                f"{what}: no module named {e.name!r} on sys.path; give the module's dotted "
                "name as imported by Python, or a path to its .py file"
            ) from e
        raise SpecError(f"{what}: importing it raised {e!r}") from e
    except Exception as e:
        raise SpecError(f"{what}: importing it raised {e!r}") from e


def load_model_spec(spec: str) -> ModelSpec:
    """Import the factory named by `spec`, call it and check what it returns.

    Raises:
        SpecError: malformed spec, missing file, module or attribute, a factory that raised,
            or one that returned something other than `(model, inputs[, kwargs])`.
    """
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise SpecError(
            f"model spec {spec!r} must look like 'package.module:factory' or 'path/file.py:factory'"
        )
    module = import_user_module(location, f"model spec {spec!r}")
    factory = getattr(module, attr, None)
    if factory is None:
        functions = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        )
        raise SpecError(
            f"model spec {spec!r}: {location!r} has no attribute {attr!r} "
            f"(functions there: {', '.join(functions[:12]) or 'none'})"
        )
    if not callable(factory):
        raise SpecError(
            f"model spec {spec!r}: {attr!r} is a {type(factory).__name__}, not a factory"
        )
    try:
        result = factory()
    except Exception as e:
        raise SpecError(f"model spec {spec!r}: the factory raised {e!r}") from e
    shape = "(model, example_inputs) or (model, example_inputs, example_kwargs)"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise SpecError(
            f"model spec {spec!r}: the factory returned a {type(result).__name__}; it must return "
            + shape
        )
    model, inputs, *rest = result
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"model spec {spec!r}: the factory's first value is a {type(model).__name__}, "
            f"not an nn.Module; it must return {shape}"
        )
    kwargs = rest[0] if rest else {}
    if not isinstance(kwargs, dict):
        raise SpecError(
            f"model spec {spec!r}: example_kwargs is a {type(kwargs).__name__}, not a dict"
        )
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return ModelSpec(model, tuple(inputs), kwargs)

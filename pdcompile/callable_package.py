"""Packages that are also public functions: `pdcompile.codegen` and `pdcompile.schedules`.

A subpackage becomes an attribute of `pdcompile` when it is first imported, hiding the public
function of the same name; making the package callable keeps `pdcompile.codegen(gm, plan)` and
`pdcompile.schedules()` working however the package was imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def make_callable(package: str, function: str) -> None:
    """Calling the package `package` calls `function` ("module:name", imported when called)."""
    module_name, name = function.split(":")

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module_name), name)(*args, **kwargs)

    sys.modules[package].__class__ = _CallablePackage

"""Code generation: a captured graph and a plan to one stage module per stage
(`stage_codegen`), with the channels between them (`staged_program`) and readable sources
(`stage_source`).

`pdcompile.codegen` is both this package and the public function: the package is callable and
calls `stage_codegen.codegen`, so `pdcompile.codegen(gm, plan)` works however it was imported.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from pdcompile.codegen.stage_codegen import codegen

        return codegen(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

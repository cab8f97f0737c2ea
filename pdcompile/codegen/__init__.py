"""Code generation: a captured graph and a plan to one stage module per stage
(`stage_codegen`), with the channels between them (`staged_program`) and readable sources
(`stage_source`). The package is callable as the public `pdcompile.codegen(gm, plan)`."""

from pdcompile.callable_package import make_callable

make_callable(__name__, "pdcompile.codegen.stage_codegen:codegen")

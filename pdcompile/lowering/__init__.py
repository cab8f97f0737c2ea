"""Code generation: a captured graph and a plan to one stage module per stage
(`stage_codegen`), with the channels between them (`staged_program`) and readable sources
(`stage_source`). The public `pdcompile.codegen(gm, plan)` is `stage_codegen.codegen`."""

"""The `pdcompile` command: arguments (`parser`), handlers (`main`), text reports and the
solver bench harness. Nothing outside this package imports it."""

from pdcompile.cli.handlers import main

__all__ = ["main"]

"""pdcompile's version (the generated stage sources name it)."""

__version__ = "0.1.0"

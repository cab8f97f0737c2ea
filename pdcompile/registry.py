"""Named plugins of one kind (solvers, schedules, cost models): registered by a decorator, the
built-in ones imported on first use, listed with the first line of their docstrings."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

from pdcompile.errors import PdcompileError

T = TypeVar("T")


class Registry(Generic[T]):
    """`kind` names what is registered ("solver"); `builtins` are the modules that register
    the built-in ones; `error` is raised for an unknown name; `aliases` maps old names to the
    registered ones (a renamed built-in: "dp" -> "dynprog"), used where no item has the name."""

    def __init__(
        self, kind: str, builtins: tuple[str, ...], error: type[PdcompileError],
        aliases: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.kind, self.builtins, self.error = kind, builtins, error
        self.aliases = dict(aliases or {})
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> None:
        """Register `item` under `name` (a name registered again is replaced)."""
        self._items[name] = item

    def get(self, name: str) -> T:
        """The item called `name` (or by an alias of it); the error lists the registered
        names."""
        self._load()
        name = self.canonical(name)
        if not isinstance(name, str) or name not in self._items:
            raise self._unknown(name)
        return self._items[name]

    def canonical(self, name: object) -> object:
        """`name`, or the registered name it is an alias of."""
        self._load()
        if isinstance(name, str) and name not in self._items and name in self.aliases:
            return self.aliases[name]
        return name

    def _unknown(self, name: object) -> PdcompileError:
        return self.error(
            f"unknown {self.kind} {name!r}; registered: {', '.join(self)} "
            f"(pdcompile.register_{self.kind.replace(' ', '_')} adds one)"
        )

    def describe(self) -> dict[str, str]:
        """Names -> the first line of each item's docstring (its class's for an instance)."""
        self._load()
        described = {}
        for name in self:
            item = self._items[name]
            doc = (item.__doc__ if callable(item) else type(item).__doc__) or ""
            described[name] = doc.strip().splitlines()[0] if doc.strip() else ""
        return described

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(sorted(self._items))

    def __contains__(self, name: object) -> bool:
        self._load()
        return self.canonical(name) in self._items

    def _load(self) -> None:
        for module in self.builtins:
            importlib.import_module(module)

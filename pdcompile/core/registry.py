"""Named plugins of one kind (solvers, schedules, cost models): registered by a decorator, the
built-in ones found by listing their package and imported on first use, listed with the first
line of their docstrings. A new solver or schedule file in its package registers itself: no
registry line names it."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Generic, TypeVar

from pdcompile.core.errors import PdcompileError

T = TypeVar("T")


class Registry(Generic[T]):
    """`kind` names what is registered ("solver"); every module of `package` (and of the
    packages of the modules in `order`) is imported on first use, so that the built-in ones
    register themselves; `order` lists some of those modules first in `builtins` (the order
    `schedule="auto"` breaks ties in; discovery needs no list); `error` is raised for an
    unknown name; `aliases` maps old names to the registered ones (a renamed built-in: "dp" ->
    "dynprog"), used where no item has the name."""

    def __init__(
        self, kind: str, order: tuple[str, ...], error: type[PdcompileError],
        aliases: dict[str, str] | None = None, *, package: str | None = None,
    ) -> None:  # fmt: skip
        self.kind, self.order, self.error = kind, tuple(order), error
        found = (package,) if package else ()
        self.packages = tuple(dict.fromkeys((*found, *(m.rpartition(".")[0] for m in order))))
        self.aliases = dict(aliases or {})
        self._items: dict[str, T] = {}
        self._modules: tuple[str, ...] | None = None  # every module found, once listed

    @property
    def builtins(self) -> tuple[str, ...]:
        """The modules of the built-in ones: those of `order` first, then the others found in
        the packages, by name."""
        self._load()
        assert self._modules is not None
        return self.order + tuple(sorted(set(self._modules) - set(self.order)))

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
        """Import every module of the packages (once), and those of `order`."""
        if self._modules is not None:
            return
        found = list(self.order)
        for package in self.packages:
            path = importlib.import_module(package).__path__
            found += [f"{package}.{m.name}" for m in pkgutil.iter_modules(path)
                      if not m.name.startswith("_")]  # fmt: skip
        for module in dict.fromkeys(found):
            importlib.import_module(module)
        self._modules = tuple(dict.fromkeys(found))

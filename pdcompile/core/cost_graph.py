"""CostGraph: the solvers' torch-free view of a model, with JSON and PipeDream `graph.txt` I/O.

A CostGraph wraps a networkx DiGraph whose node insertion order is a topological order. Every
node carries all of `NODE_ATTRS` (seconds and bytes for one batch of `batch_size` rows; its
optimizer step per step), every edge carries `bytes`; the graph carries the loss function's
seconds per batch (`loss_forward_s`, `loss_backward_s`) and the optimizer that priced the
nodes' `optimizer_s`. A graph profiled at several row counts (`rows`) also carries every node's
times (`row_s`) and the loss's (`loss_row_s`) at each of them, which `scaled` reads at any row
count (`pdcompile.core.row_curves`); a graph of one profile scales linearly. This module imports
only
the standard library and networkx, so solvers and the CLI can plan on a machine without torch.
See docs/cost_graph.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.core.cost_attrs import (
    ACCUMULATE_ATTRS,
    FLOAT_ATTRS,
    FLOP_ATTRS,
    INT_ATTRS,
    KINDS,
    MEMORY_PARTS,
    NODE_ATTRS,
    SCALED_FLOAT_ATTRS,
    SETTABLE,
    SPREAD_ATTRS,
    STEP_ATTRS,
    TIME_ATTRS,
    check_attr,
    check_batch_size,
    check_edge,
    check_edge_bytes,
    check_meta,
    check_node,
    check_optimizer_name,
    check_seconds,
    split_defaults,
)
from pdcompile.core.errors import CostError
from pdcompile.core.regular_file import read_regular_text
from pdcompile.core.row_curves import (
    LOSS_PARTS,
    anchored,
    check_points,
    check_rows,
    curve_at,
    describe,
    node_points,
)
from pdcompile.core.text import human_bytes, human_seconds

__all__ = ["FLOAT_ATTRS", "INT_ATTRS", "KINDS", "NODE_ATTRS", "CostGraph"]

FORMAT = "pdcompile.costgraph"
# 2 added the split backward (`cost_attrs.SPLIT_ATTRS`), 3 the loss, the optimizer step and the
# profile's spread (`cost_attrs.STEP_COST_ATTRS`), 4 the times at several row counts (`rows`,
# `loss_row_s`, `cost_attrs.ROW_ATTRS`); versions 1 to 3 still read
VERSION = 4
READS = (1, 2, 3, 4)


class CostGraph:
    """A DAG of per-node costs for one batch: what the solvers read.

    Args:
        graph: optional networkx DiGraph to copy; its node insertion order must be topological.
            Missing node attributes take their defaults (see `add_node`); edges need `bytes`.
        batch_size: rows of the batch the costs are for (None if unknown).
        meta: JSON-serializable provenance (`source`, model, device, optimizer, ...).
        loss_forward_s, loss_backward_s: seconds per batch of the loss function's forward and
            backward on the model's output (0.0: not priced); `loss_s` is their sum. They belong
            to the stage holding `loss_node`.
        optimizer: the optimizer whose step the nodes' `optimizer_s` time ("sgd", "adam", a
            factory's description); "" when they are not priced.
        rows: the row counts the times were measured (or priced) at, increasing: then each
            node's `row_s` (or None) holds its four times at each, and `loss_row_s` the loss's
            two (`scaled` reads them at any row count). () (one profile): times scale linearly.
        loss_row_s: `(loss_forward_s, loss_backward_s)` at each of `rows`, or None.

    Raises:
        CostError: an attribute is unknown or ill-typed, the order is not topological, or times
            per row count do not match `rows`.

    Example:
        >>> g = CostGraph(batch_size=8)
        >>> g.add_node("x", kind="input", output_bytes=64)
        >>> g.add_node("fc", forward_s=1e-3, backward_s=2e-3, param_bytes=400, output_bytes=32)
        >>> g.add_edge("x", "fc", bytes=64)
        >>> g.nodes, g.graph.nodes["fc"]["memory_bytes"], g.graph.nodes["fc"]["backward_input_s"]
        (['x', 'fc'], 400, 0.001)
    """

    def __init__(
        self,
        graph: nx.DiGraph | None = None,
        batch_size: int | None = None,
        meta: dict[str, Any] | None = None,
        *,
        loss_forward_s: float = 0.0,
        loss_backward_s: float = 0.0,
        optimizer: str = "",
        rows: tuple[int, ...] = (),
        loss_row_s: tuple[tuple[float, float], ...] | None = None,
    ) -> None:
        self.graph = nx.DiGraph()
        self.batch_size = check_batch_size(batch_size)
        self.meta = check_meta(meta)
        self.loss_forward_s = check_seconds("loss_forward_s", loss_forward_s)
        self.loss_backward_s = check_seconds("loss_backward_s", loss_backward_s)
        self.optimizer = check_optimizer_name(optimizer)
        self.rows = check_rows(rows)
        if self.rows and self.batch_size is None:
            raise CostError(
                f"rows={list(self.rows)} need a batch_size (the rows the times are for)"
            )
        self.loss_row_s = check_points("loss_row_s", loss_row_s, len(self.rows), len(LOSS_PARTS))
        self._index: dict[str, int] = {}
        self._points: dict[str, tuple[tuple, tuple]] = {}  # node -> (what it was read from, points)
        if graph is None:
            return
        for node, data in graph.nodes(data=True):
            attrs = dict(data)
            memory = attrs.pop("memory_bytes", None)
            self.add_node(node, **attrs)
            if memory is not None and memory != self.graph.nodes[node]["memory_bytes"]:
                raise CostError(
                    f"node {node!r}: memory_bytes={memory!r} is not param + grad + optimizer + "
                    f"activation bytes ({self.graph.nodes[node]['memory_bytes']}); it is derived: "
                    "drop it"
                )
        for u, v, data in graph.edges(data=True):
            if "bytes" not in data or not set(data) <= {"bytes", "grad"}:
                raise CostError(
                    f"edge {u!r} -> {v!r}: edges carry 'bytes' and optionally 'grad'; got "
                    f"{sorted(data)}"
                )
            self.add_edge(u, v, data["bytes"], data.get("grad", True))

    # -- building -------------------------------------------------------------------------

    def add_node(self, node_id: str, **attrs: Any) -> None:
        """Append a node (after every node added so far in the topological order).

        Args:
            node_id: unique non-empty string.
            **attrs: any of `kind` ("compute"), `forward_s`, `backward_s`, `flops_forward`,
                `flops_backward`, `optimizer_s`, `forward_spread`, `backward_spread` (0.0),
                `param_bytes`, `grad_bytes`, `optimizer_bytes`,
                `activation_bytes`, `output_bytes` (0), `description`, `scope` (""), `members`
                ((node_id,)), `activation_sizes` (None); the split backward's
                `backward_input_s` and `backward_weight_s` (neither given: half of
                `backward_s` each; one given: the other is the rest of `backward_s`) and
                `weight_grad_activation_bytes` (`activation_bytes`), `row_s` (None: the times
                at each of the graph's `rows`). `memory_bytes` is derived.

        Raises:
            CostError: duplicate id, unknown attribute, `memory_bytes` given, a bad value,
                `weight_grad_activation_bytes` above `activation_bytes`, or `row_s` not one
                entry per row count.
        """
        if not isinstance(node_id, str) or not node_id:
            raise CostError(f"node ids must be non-empty strings, got {node_id!r}")
        if node_id in self.graph:
            raise CostError(f"node {node_id!r} is already in the CostGraph; ids must be unique")
        if "memory_bytes" in attrs:
            raise CostError(
                f"node {node_id!r}: memory_bytes is derived (param + grad + optimizer + "
                "activation bytes); set those instead"
            )
        data: dict[str, Any] = {"kind": "compute", "forward_s": 0.0, "backward_s": 0.0}
        data.update(dict.fromkeys((*STEP_ATTRS, *ACCUMULATE_ATTRS, *SPREAD_ATTRS), 0.0))
        data.update(dict.fromkeys(INT_ATTRS, 0))
        data.update(flops_forward=0.0, flops_backward=0.0, description="", scope="")
        data.update(members=(node_id,), activation_sizes=None, row_s=None)
        for name, value in attrs.items():
            data[name] = check_attr(node_id, name, value)
        self._check_row_s(node_id, data["row_s"])
        split_defaults(node_id, data, set(attrs))
        data["memory_bytes"] = sum(data[k] for k in MEMORY_PARTS)
        self.graph.add_node(node_id, **{name: data[name] for name in NODE_ATTRS})
        self._index[node_id] = len(self._index)

    def add_edge(self, u: str, v: str, bytes: int, grad: bool = True) -> None:
        """Add the edge `u -> v` carrying `bytes` per batch; `u` must come before `v`. `grad`:
        whether a gradient flows back along it (False for integer ids, masks and values outside
        autograd: pipelines send nothing back for them).

        Raises:
            CostError: an endpoint is missing, the edge exists, or it goes backwards in the order.
        """
        if len(self._index) != self.graph.number_of_nodes():
            self._index = {n: i for i, n in enumerate(self.graph)}
        for end in (u, v):
            if end not in self._index:
                raise CostError(f"edge {u!r} -> {v!r}: node {end!r} is not in the CostGraph")
        if self.graph.has_edge(u, v):
            raise CostError(f"edge {u!r} -> {v!r} already exists; add each edge once")
        if self._index[u] >= self._index[v]:
            raise CostError(
                f"edge {u!r} -> {v!r} goes backwards in the node order (node {v!r} was added "
                f"before {u!r}); add nodes in a topological order (e.g. networkx.topological_sort)"
            )
        if not isinstance(grad, bool):
            raise CostError(f"edge {u!r} -> {v!r}: 'grad' must be true or false, got {grad!r}")
        self.graph.add_edge(u, v, bytes=check_edge_bytes(u, v, bytes), grad=grad)

    def _check_row_s(self, node: str, row_s: tuple | None) -> None:
        if row_s is not None and len(row_s) != len(self.rows):
            raise CostError(
                f"node {node!r}: row_s has {len(row_s)} entries, the graph's rows are "
                f"{list(self.rows)}: give one (forward, backward, I, W) per row count"
            )

    def copy(self) -> CostGraph:
        """An equal, independent CostGraph."""
        return CostGraph(self.graph, self.batch_size, self.meta, **self.step_costs())

    def step_costs(self) -> dict[str, Any]:
        """The graph-level costs as keyword arguments of `CostGraph(...)`: `loss_forward_s`,
        `loss_backward_s`, `optimizer`, `rows`, `loss_row_s` (a derived graph passes them on)."""
        return {
            "loss_forward_s": self.loss_forward_s,
            "loss_backward_s": self.loss_backward_s,
            "optimizer": self.optimizer,
            "rows": self.rows,
            "loss_row_s": self.loss_row_s,
        }

    # -- reading ---------------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        """Node ids in the (topological) order."""
        return list(self.graph.nodes)

    @property
    def row_scaling(self) -> str:
        """How the times depend on a microbatch's rows: "measured at rows 1, 4, 32" (or
        "priced at", analytic costs), or "assumed linear (one profile)"."""
        how = "priced" if self.meta.get("source") == "analytic" else "measured"
        return describe(self.rows, how)

    @property
    def loss_s(self) -> float:
        """Seconds per batch of the loss function, forward and backward (0.0: not priced)."""
        return self.loss_forward_s + self.loss_backward_s

    @property
    def loss_node(self) -> str | None:
        """The node the loss function follows: the last node of kind "output", else the last
        node (a coarsened graph's last layer holds the output); None for an empty graph. The
        stage holding it pays `loss_s`."""
        output = last = None
        for node, kind in self.graph.nodes(data="kind"):
            last = node
            if kind == "output":
                output = node
        return output if output is not None else last

    def compute_times(self, order: Iterable[str] | None = None) -> list[float]:
        """Seconds per batch a stage spends on each node of `order` (default: the graph's):
        `forward_s + backward_s` (0 for a data source, kind "input"), plus `loss_s` at
        `loss_node`. What the solvers sum."""
        loss_node, loss = self.loss_node, self.loss_s
        times = []
        for node in self.graph.nodes if order is None else order:
            data = self.graph.nodes[node]
            own = 0.0 if data["kind"] == "input" else data["forward_s"] + data["backward_s"]
            times.append(own + loss if node == loss_node else own)
        return times

    def node_points(self, node: str) -> tuple[tuple[float, ...], ...]:
        """`node`'s four times at each of `rows` (`row_curves.node_points`: its points anchored
        at its times), kept until its times, points, `rows` or `batch_size` change: a planner
        prices the same nodes in many stages."""
        data = self.graph.nodes[node]
        source = (self.rows, self.batch_size, data["row_s"], tuple(data[t] for t in TIME_ATTRS))
        kept = self._points.get(node)
        if kept is None or kept[0] != source:
            kept = (source, node_points(*source))
            self._points[node] = kept
        return kept[1]

    def totals(self) -> dict[str, float]:
        """Sums over all nodes (`math.fsum`) of every time (`optimizer_s` too), byte and flop
        attribute (not the spreads)."""
        data = [d for _, d in self.graph.nodes(data=True)]
        names = (*TIME_ATTRS, *STEP_ATTRS, *ACCUMULATE_ATTRS, *INT_ATTRS, *FLOP_ATTRS)
        return {name: math.fsum(d[name] for d in data) for name in names}

    def validate(self) -> None:
        """Check the graph after direct edits of `.graph`.

        Raises:
            CostError: a cycle, an order that is not topological, a missing, unknown or
                ill-typed attribute, a negative number, a stale `memory_bytes` or
                `weight_grad_activation_bytes` above `activation_bytes`.
        """
        pos = {n: i for i, n in enumerate(self.graph)}
        for node, data in self.graph.nodes(data=True):
            check_node(node, data)
        if not nx.is_directed_acyclic_graph(self.graph):
            cycle = " -> ".join(str(u) for u, _ in nx.find_cycle(self.graph))
            raise CostError(f"the CostGraph has a cycle ({cycle}); a CostGraph must be a DAG")
        for u, v, data in self.graph.edges(data=True):
            check_edge(u, v, data)
            if pos[u] > pos[v]:
                raise CostError(
                    f"edge {u!r} -> {v!r} goes backwards in the node order; the insertion order "
                    "must be topological: rebuild with nodes in networkx.topological_sort order"
                )
        check_batch_size(self.batch_size)
        check_meta(self.meta)
        if check_rows(self.rows) != self.rows or (self.rows and self.batch_size is None):
            raise CostError(f"rows must be an increasing tuple of row counts with a batch_size, "
                            f"got {self.rows!r}")  # fmt: skip
        check_points("loss_row_s", self.loss_row_s, len(self.rows), len(LOSS_PARTS))
        for node, row_s in self.graph.nodes(data="row_s"):
            self._check_row_s(node, row_s)
        for name in ("loss_forward_s", "loss_backward_s"):
            if type(getattr(self, name)) is not float:
                raise CostError(f"{name} must be a float, got {getattr(self, name)!r}")
            check_seconds(name, getattr(self, name))
        check_optimizer_name(self.optimizer)

    def scaled(self, batch_size: int) -> CostGraph:
        """The costs for another batch size (rows per microbatch).

        Times (the split backward's parts and the loss too) are read off their curves where
        the graph has `rows` (`pdcompile.core.row_curves`: the points themselves at a profiled
        count,
        linear between two, the line through the last two beyond them), each anchored at this
        graph's times, so a time edited in place scales its curve alike; the points are kept,
        so `g.scaled(a).scaled(b)` has the times of `g.scaled(b)`. Without rows (one profile)
        they scale by `batch_size / self.batch_size`. Flops, activation bytes (and the part of
        them W keeps), output bytes, `activation_sizes` and edge bytes scale by that factor
        (integers rounded half up); parameter, gradient and optimizer bytes, `optimizer_s`
        (per step) and the spreads (relative) do not; `memory_bytes` is re-derived.

        Raises:
            CostError: this graph has no batch size, or `batch_size` is not an integer >= 1.
        """
        if self.batch_size is None:
            raise CostError(
                "scaled(): this CostGraph has no batch_size (PipeDream files record none); "
                "pass batch_size= to CostGraph.from_pipedream or set .batch_size first"
            )
        new = check_batch_size(batch_size)
        if new is None:
            raise CostError("scaled(): batch_size must be an integer >= 1, got None")
        old, factor = self.batch_size, new / self.batch_size

        def whole(x: int) -> int:
            return (2 * x * new + old) // (2 * old)

        loss = (self.loss_forward_s, self.loss_backward_s)
        loss_points = self.loss_row_s
        if loss_points is None:
            loss = tuple(x * factor for x in loss)
        else:
            loss_points = anchored(self.rows, loss_points, old, loss)
            loss = curve_at(self.rows, loss_points, new)
        out = CostGraph(
            batch_size=new, meta=self.meta, loss_forward_s=loss[0], loss_backward_s=loss[1],
            optimizer=self.optimizer, rows=self.rows, loss_row_s=loss_points,
        )  # fmt: skip
        for node, data in self.graph.nodes(data=True):
            attrs = {name: data[name] for name in SETTABLE}
            for name in SCALED_FLOAT_ATTRS:
                attrs[name] = data[name] * factor
            if data["row_s"] is not None:
                points = anchored(self.rows, data["row_s"], old, [data[t] for t in TIME_ATTRS])
                attrs.update(zip(TIME_ATTRS, curve_at(self.rows, points, new), strict=True))
                attrs["row_s"] = points
            for name in ("activation_bytes", "weight_grad_activation_bytes", "output_bytes"):
                attrs[name] = whole(data[name])
            if data["activation_sizes"] is not None:
                attrs["activation_sizes"] = tuple(
                    whole(x) if isinstance(x, int) else x * factor for x in data["activation_sizes"]
                )
            out.add_node(node, **attrs)
        for u, v, data in self.graph.edges(data=True):
            out.add_edge(u, v, whole(data["bytes"]), data["grad"])
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CostGraph):
            return NotImplemented
        return (
            self.batch_size == other.batch_size
            and self.meta == other.meta
            and self.step_costs() == other.step_costs()
            and list(self.graph.nodes(data=True)) == list(other.graph.nodes(data=True))
            and dict(((u, v), d) for u, v, d in self.graph.edges(data=True))
            == dict(((u, v), d) for u, v, d in other.graph.edges(data=True))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"<CostGraph {self.graph.number_of_nodes()} nodes, {self.graph.number_of_edges()} "
            f"edges, batch_size={self.batch_size}>"
        )

    def __str__(self) -> str:
        t = self.totals()
        source = self.meta.get("source", "unknown")
        batch = "unknown" if self.batch_size is None else str(self.batch_size)
        return "\n".join(
            [
                f"CostGraph ({source}): {_count(self.graph.number_of_nodes(), 'node')}, "
                f"{_count(self.graph.number_of_edges(), 'edge')}, batch size {batch}",
                f"  time per batch: forward {human_seconds(t['forward_s'])}, "
                f"backward {human_seconds(t['backward_s'])}",
                f"  memory {human_bytes(t['memory_bytes'])}: "
                f"parameters {human_bytes(t['param_bytes'])}, "
                f"gradients {human_bytes(t['grad_bytes'])}, "
                f"optimizer {human_bytes(t['optimizer_bytes'])}, "
                f"activations {human_bytes(t['activation_bytes'])}",
                f"  flops: forward {_flops(t['flops_forward'])}, "
                f"backward {_flops(t['flops_backward'])}",
                *self._step_lines(t["optimizer_s"]),
                f"  times against rows: {self.row_scaling}",
            ]
        )

    def _step_lines(self, optimizer_s: float) -> list[str]:
        """The loss and the optimizer step, when either is priced (older graphs: no line)."""
        if not (self.loss_s or self.optimizer or optimizer_s):
            return []
        loss = (
            f"forward {human_seconds(self.loss_forward_s)}, "
            f"backward {human_seconds(self.loss_backward_s)}"
            if self.loss_s
            else "not priced"
        )
        step = (
            f"{human_seconds(optimizer_s)} ({self.optimizer or 'unnamed'})"
            if self.optimizer or optimizer_s
            else "not priced"
        )
        return [f"  loss per batch: {loss}; optimizer step: {step}"]

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The graph as JSON (one node or edge per line); `from_json` reads it back exactly."""
        from pdcompile.core.cost_graph_json import format_json

        return format_json(self)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> CostGraph:
        """Read a graph written by `to_json`.

        Args:
            text: the JSON text.
            source: where it came from, for error messages (a path).

        Raises:
            CostError: corrupt or truncated JSON (with line and column), wrong format or version,
                or a missing, unknown or ill-typed field (naming the node or edge).
        """
        from pdcompile.core.cost_graph_json import read_json

        return read_json(text, source)

    def save(self, path: str | Path) -> None:
        """Write `to_json()` to `path`.

        Raises:
            CostError: the file cannot be written.
        """
        try:
            Path(path).write_text(self.to_json(), encoding="utf-8")
        except OSError as e:
            raise CostError(f"cannot write CostGraph file {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | Path) -> CostGraph:
        """Read a file written by `save`.

        Raises:
            CostError: the file cannot be read or is not a valid CostGraph file.
        """
        return cls.from_json(read_text(path, "CostGraph"), source=str(path))

    # -- PipeDream -------------------------------------------------------------------------

    @classmethod
    def from_pipedream(cls, path: str | Path, batch_size: int | None = None) -> CostGraph:
        """Import a PipeDream profile (`graph.txt`); docs/cost_graph.md has the mapping.

        Args:
            path: the profile.
            batch_size: the minibatch the profile was taken with (files do not record it).

        Raises:
            CostError: the file cannot be read, a line is malformed (file, line number and
                text), a node is defined twice, an edge names an unknown node, or there is a cycle.
        """
        from pdcompile.core.pipedream_format import read_pipedream

        return read_pipedream(Path(path), batch_size)

    def to_pipedream(self, path: str | Path) -> None:
        """Write the graph in PipeDream's `graph.txt` format (times in milliseconds).

        Files imported with `from_pipedream` are written back with the same lines in the same
        order and numbers that read back exactly.

        Raises:
            CostError: a node id or description cannot be written in that format.
        """
        from pdcompile.core.pipedream_format import format_pipedream

        text = format_pipedream(self)
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError as e:
            raise CostError(f"cannot write PipeDream file {path}: {e.strerror or e}") from None


def read_text(path: str | Path, what: str) -> str:
    """The text of `path`, a regular file (a FIFO is refused, never opened to block).

    Raises:
        CostError: it cannot be read, is no regular file or no UTF-8 text.
    """
    try:
        return read_regular_text(path)
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise CostError(f"cannot read {what} file {path}: {reason}") from None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _flops(f: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if f < 1000:
            return f"{f:.4g} {unit}FLOP"
        f /= 1000
    return f"{f:.4g} PFLOP"

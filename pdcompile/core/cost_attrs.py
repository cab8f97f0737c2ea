"""The attributes a CostGraph's nodes and edges carry (`NODE_ATTRS`, edge `bytes`), and the checks
that normalise them or raise a CostError naming the node or edge. Standard library only.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from pdcompile.core.errors import CostError
from pdcompile.core.row_curves import PARTS, check_points

KINDS = ("input", "compute", "output")
# `backward_s` is the fused backward; `backward_input_s` (I: the gradients of the node's inputs)
# and `backward_weight_s` (W: of its parameters) are the parts a split backward runs, measured
# on their own, so I + W need not equal `backward_s` (docs/cost_graph.md).
TIME_ATTRS = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")
FLOP_ATTRS = ("flops_forward", "flops_backward")
# Seconds of one optimizer step over the node's parameters: per step, so not scaled by batch.
STEP_ATTRS = ("optimizer_s",)
# Seconds a backward takes to add the gradients of the node's parameters to those they hold
# (every microbatch of an update but its first): per microbatch, whatever its rows.
ACCUMULATE_ATTRS = ("accumulate_s",)
# Relative dispersion of the profiled repeats of forward_s and backward_s ((p75 - p25) / median,
# unitless): not scaled by batch, not summed.
SPREAD_ATTRS = ("forward_spread", "backward_spread")
# The per-batch numbers: what `CostGraph.scaled` multiplies.
SCALED_FLOAT_ATTRS = (*TIME_ATTRS, *FLOP_ATTRS)
FLOAT_ATTRS = (*TIME_ATTRS, *STEP_ATTRS, *ACCUMULATE_ATTRS, *SPREAD_ATTRS, *FLOP_ATTRS)
INT_ATTRS = (
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "weight_grad_activation_bytes",  # of activation_bytes, those kept from the forward to W
    "output_bytes",
    "memory_bytes",
)
MEMORY_PARTS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
# Added in CostGraph JSON version 2; a version-1 record without them takes their defaults
# (`split_defaults`).
SPLIT_ATTRS = ("backward_input_s", "backward_weight_s", "weight_grad_activation_bytes")
# Added in version 3 (default 0.0 in older files: the optimizer step unpriced, spread unknown).
STEP_COST_ATTRS = (*STEP_ATTRS, *SPREAD_ATTRS)
# Added in version 4: the node's TIME_ATTRS at each of the graph's `rows` (None in older files
# and for one profile: the times scale linearly; docs/cost_graph.md, pdcompile/core/row_curves.py),
# and its gradients' accumulation (0.0 in older files: unpriced).
ROW_ATTRS = ("row_s", *ACCUMULATE_ATTRS)
NODE_ATTRS = (
    "kind",
    *TIME_ATTRS,
    *STEP_ATTRS,
    *ACCUMULATE_ATTRS,
    *SPREAD_ATTRS,
    *INT_ATTRS,
    *FLOP_ATTRS,
    "description",
    "scope",
    "members",
    "activation_sizes",
    *ROW_ATTRS,
)
SETTABLE = tuple(a for a in NODE_ATTRS if a != "memory_bytes")


def check_attr(node: str, name: str, value: Any) -> Any:
    """The normalized value of one node attribute; CostError naming the node if it is wrong."""

    def bad(expected: str) -> CostError:
        return CostError(f"node {node!r}: attribute {name!r} must be {expected}, got {value!r}")

    def number(x: Any) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and _finite(x)

    if name in FLOAT_ATTRS:
        if not number(value) or value < 0:
            raise bad("a finite number >= 0 (seconds, flops or a relative spread)")
        return float(value) + 0.0  # + 0.0 turns -0.0 into 0.0
    if name in INT_ATTRS:
        if not number(value) or value < 0 or not float(value).is_integer():
            raise bad("a whole number of bytes >= 0")
        return int(value)
    if name == "kind":
        if value not in KINDS:
            raise bad(f"one of {', '.join(KINDS)}")
        return value
    if name in ("description", "scope"):
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if name == "members":
        if not isinstance(value, (list, tuple)) or not value:
            raise bad("a non-empty tuple of node ids")
        if not all(isinstance(m, str) and m for m in value):
            raise bad("a tuple of non-empty strings")
        return tuple(value)
    if name == "row_s":
        return check_points(f"node {node!r}: row_s", value, None, len(PARTS))
    if name == "activation_sizes":
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(number(x) and x >= 0 for x in value):
            raise bad("None or a tuple of byte counts >= 0")
        return tuple(int(x) if isinstance(x, numbers.Integral) else float(x) for x in value)
    raise CostError(
        f"node {node!r}: unknown attribute {name!r}; node attributes are {', '.join(SETTABLE)}"
    )


def split_defaults(node: str, data: dict[str, Any], given: set[str]) -> None:
    """Fill the split-backward attributes `given` lacks, in place, and check them against the
    rest of `data` (every other attribute already checked).

    Defaults, for imported profiles and hand-built nodes: neither part given, half of
    `backward_s` each; one given, the other is `backward_s` less it (at least 0);
    `weight_grad_activation_bytes`: all of `activation_bytes` (without a measurement, W is taken
    to keep every saved tensor, as a fused backward does until its end).

    Raises:
        CostError: `weight_grad_activation_bytes` above `activation_bytes`.
    """
    parts = ("backward_input_s", "backward_weight_s")
    known = [p for p in parts if p in given]
    if not known:
        data["backward_input_s"] = data["backward_weight_s"] = data["backward_s"] / 2
    elif len(known) == 1:
        other = parts[known[0] == parts[0]]
        data[other] = max(data["backward_s"] - data[known[0]], 0.0)
    if "weight_grad_activation_bytes" not in given:
        data["weight_grad_activation_bytes"] = data["activation_bytes"]
    check_weight_grad_bytes(node, data)


def check_weight_grad_bytes(node: str, data: dict[str, Any]) -> None:
    if data["weight_grad_activation_bytes"] > data["activation_bytes"]:
        raise CostError(
            f"node {node!r}: weight_grad_activation_bytes={data['weight_grad_activation_bytes']} "
            f"is above activation_bytes={data['activation_bytes']}; it is the part of the "
            "activations kept until the weight gradient (W) runs, at most all of them"
        )


def check_edge_bytes(u: str, v: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not _finite(value)
        or value < 0
        or not float(value).is_integer()
    ):
        raise CostError(f"edge {u!r} -> {v!r}: 'bytes' must be a whole number >= 0, got {value!r}")
    return int(value)


def check_seconds(name: str, value: Any) -> float:
    """A graph-level time (`loss_forward_s`, `loss_backward_s`) as a float >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not _finite(value)
        or value < 0
    ):
        raise CostError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value) + 0.0


def check_optimizer_name(value: Any) -> str:
    """The graph's `optimizer` (what priced the nodes' `optimizer_s`): a string, "" for none."""
    if not isinstance(value, str):
        raise CostError(
            f"optimizer must be a string naming the optimizer that priced optimizer_s ('' for "
            f"none), got {value!r}"
        )
    return value


def check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise CostError(f"batch_size must be None or an integer >= 1, got {batch_size!r}")
    return batch_size


def _finite(x: numbers.Real) -> bool:
    """Finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_meta(meta: Any) -> dict[str, Any]:
    """A deep JSON-normalized copy of `meta` (tuples become lists): JSON round trips are exact."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise CostError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise CostError(f"meta must be JSON-serializable (str keys, no NaN): {e}") from None


def check_node(node: Any, data: dict[str, Any]) -> None:
    """Raise `CostError` unless `data` holds exactly the node attributes, each well typed and in
    range, `memory_bytes` their sum of parts, and W's bytes within the activations."""
    if not isinstance(node, str) or not node:
        raise CostError(f"node ids must be non-empty strings, got {node!r}")
    missing = [a for a in NODE_ATTRS if a not in data]
    unknown = sorted(set(data) - set(NODE_ATTRS))
    if missing or unknown:
        raise CostError(
            f"node {node!r}: missing attributes {missing}, unknown attributes "
            f"{unknown}; build nodes with CostGraph.add_node"
        )
    for name in NODE_ATTRS:
        value = check_attr(node, name, data[name])
        if type(value) is not type(data[name]) or value != data[name]:
            raise CostError(
                f"node {node!r}: attribute {name!r} is {data[name]!r} of type "
                f"{type(data[name]).__name__}; expected {type(value).__name__}"
            )
    derived = sum(data[k] for k in MEMORY_PARTS)
    if data["memory_bytes"] != derived:
        raise CostError(
            f"node {node!r}: memory_bytes is {data['memory_bytes']} but param + grad + "
            f"optimizer + activation bytes is {derived}; rebuild the node with add_node"
        )
    check_weight_grad_bytes(node, data)


def check_edge(u: Any, v: Any, data: dict[str, Any]) -> None:
    """Raise `CostError` unless an edge holds `bytes` (an int >= 0) and `grad` (a bool)."""
    if set(data) != {"bytes", "grad"} or not isinstance(data["grad"], bool):
        raise CostError(f"edge {u!r} -> {v!r}: expected 'bytes' and 'grad' (a bool), got {data}")
    check_edge_bytes(u, v, data["bytes"])
    if type(data["bytes"]) is not int:
        raise CostError(f"edge {u!r} -> {v!r}: 'bytes' must be an int")

"""What two processes' captures of one model disagree on, in words a user can act on.

`describe(gm, options)` is a small, picklable summary (one line per node with its user source
line, the tensors' names and shapes, the call's options) that ranks exchange only when their
fingerprints differ; `first_difference` names the first thing that differs.
"""

from __future__ import annotations

import os
from typing import Any

import torch.fx as fx

from pdcompile.capture.tracing import user_line

HASH_SEED_REMEDY = (
    "When the model's Python iterates over a set (or a dict built from one) of strings, the order "
    "follows each process's hash seed: set PYTHONHASHSEED to one value for every rank (torchrun "
    "passes the environment on), or iterate over sorted(...) in the model"
)


def describe(gm: fx.GraphModule, options: dict[str, Any]) -> dict[str, Any]:
    """The summary of one rank's capture and call."""
    nodes = [(n.format_node(), user_line(n).strip()) for n in gm.graph.nodes]
    tensors = [f"{name}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
               for name, t in [*gm.named_parameters(), *gm.named_buffers()]]  # fmt: skip
    return {"nodes": nodes, "tensors": tensors, "options": {k: repr(v) for k, v in options.items()},
            "hash_seed": os.environ.get("PYTHONHASHSEED", "random")}  # fmt: skip


def first_difference(rank: int, mine: dict[str, Any], reference: dict[str, Any]) -> str:
    """The first difference between `rank`'s summary and rank 0's, with its remedy."""
    for key, value in reference["options"].items():
        if mine["options"].get(key) != value:
            return (f"option {key}={mine['options'].get(key)} on rank {rank} but {value} on rank "
                    "0: call pdcompile.compile with the same arguments on every rank")  # fmt: skip
    ours, theirs = mine["nodes"], reference["nodes"]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a[0] != b[0]:
            seeds = f"rank 0 {reference['hash_seed']}, rank {rank} {mine['hash_seed']}"
            return (
                f"node {i} of the graph is `{b[0]}`{_at(b[1])} on rank 0 but `{a[0]}`"
                f"{_at(a[1])} on rank {rank} (PYTHONHASHSEED: {seeds}). The graph depends on "
                f"per-process state in the model's code, or the ranks ran other code. "
                f"{HASH_SEED_REMEDY}"
            )
    if len(ours) != len(theirs):
        return (f"the graph has {len(theirs)} nodes on rank 0 but {len(ours)} on rank {rank}: the "
                "ranks captured other code or other example inputs")  # fmt: skip
    for a, b in zip(mine["tensors"], reference["tensors"], strict=False):
        if a != b:
            return f"tensor {b} on rank 0 is {a} on rank {rank}: load the same weights everywhere"
    return (
        f"the example inputs or the plan differ between rank 0 and rank {rank}: pass the "
        "same shapes, dtypes and plan on every rank"
    )


def _at(line: str) -> str:
    return f" {line}" if line else ""

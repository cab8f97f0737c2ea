"""Graph drawings coloured by a plan (torch-free): each node's stage, its fill and edge styles."""

from __future__ import annotations

from collections.abc import Iterable

from pdcompile.core.errors import PartitionError
from pdcompile.core.text import dot_quote, human_bytes
from pdcompile.passes.planning.plans import Plan

# ColorBrewer Set3: light enough for black labels; stages beyond 12 reuse them in order
COLOURS = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
    "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
)  # fmt: skip
CROSSING = 'color="#c44e52", fontcolor="#c44e52", penwidth=2'  # an edge between two stages


def stage_colour(stage: int) -> str:
    """The fill colour of stage `stage`."""
    return COLOURS[stage % len(COLOURS)]


def stages_of(plan: Plan, nodes: Iterable[str], graph: str) -> dict[str, int]:
    """Node name -> stage for the nodes of `plan`, checked against the drawn graph's `nodes`.

    Raises:
        PartitionError: the plan places nodes that `graph` (its description) does not have.
    """
    names = set(nodes)
    stage_of = plan.stage_of
    missing = [n for n in stage_of if n not in names]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        shown = ", ".join(missing[:8]) + more
        raise PartitionError(
            f"the plan places {len(missing)} node(s) that {graph} does not have: {shown}; draw "
            "the INPUT the plan was made from (a SPEC with the same --leaf, --method and "
            "--eval, or the CostGraph JSON of a coarsened plan)"
        )
    return stage_of


def crosses(stage: dict[str, int], source: str, target: str) -> bool:
    """Whether an edge joins two nodes the plan places on different stages."""
    return source in stage and target in stage and stage[source] != stage[target]


def crossing_edge(label: str, nbytes: int) -> str:
    """DOT attributes of an edge between two stages: `label` and the bytes it carries."""
    text = f"{label}\n{human_bytes(nbytes)}" if label else human_bytes(nbytes)
    return f"label={dot_quote(text)}, {CROSSING}"

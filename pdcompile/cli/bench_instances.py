"""Instances for `pdcompile bench-solvers`: named CostGraphs to plan, read from what an INPUT
names (a PipeDream profile, a CostGraph JSON file, a model spec) or built (`chain:N[:SEED]`,
`dag:N[:SEED]`: synthetic chains and DAGs with random costs, deterministic in the seed).
Torch-free except for model specs.

Example:
    >>> [(i.name, len(i.cost_graph.nodes)) for i in load_instances(["chain:40", "dag:25:1"])]
    [('chain:40', 40), ('dag:25:1', 25)]
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import SpecError

__all__ = ["Instance", "load_instance", "load_instances", "synthetic_chain", "synthetic_dag"]

_SYNTHETIC = re.compile(r"^(chain|dag):(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class Instance:
    """A named CostGraph to plan; `source` says where it came from."""

    name: str
    cost_graph: CostGraph
    source: str


def _add_layer(g: CostGraph, rng: random.Random, name: str, inputs: Sequence[str]) -> None:
    """A node with random costs (1-5 ms forward, 2-10 ms backward, 1-50 MB parameters)."""
    params = rng.randint(10**6, 5 * 10**7)
    g.add_node(
        name, forward_s=rng.uniform(1e-3, 5e-3), backward_s=rng.uniform(2e-3, 1e-2),
        param_bytes=params, grad_bytes=params, activation_bytes=rng.randint(10**6, 10**7),
        output_bytes=rng.randint(10**6, 10**7),
    )  # fmt: skip
    for u in inputs:
        g.add_edge(u, name, g.graph.nodes[u]["output_bytes"])


def synthetic_chain(layers: int, seed: int = 0) -> CostGraph:
    """A chain of `layers` nodes `l0 -> l1 -> ...` with random costs (deterministic in `seed`)."""
    rng = random.Random(seed)
    g = CostGraph(batch_size=32, meta={"source": f"synthetic chain:{layers}:{seed}"})
    for i in range(layers):
        _add_layer(g, rng, f"l{i}", [f"l{i - 1}"] if i else [])
    return g


def synthetic_dag(num_nodes: int, seed: int = 0) -> CostGraph:
    """A DAG of `num_nodes` nodes with random costs (deterministic in `seed`), built of blocks:
    plain layers, residual blocks (2-4 layers and a merge that also reads the block's input),
    branches (2-3 parallel paths of 1-3 layers joined by a merge), and now and then a long skip
    from one of the last 16 nodes into a plain layer."""
    rng = random.Random(seed)
    g = CostGraph(batch_size=32, meta={"source": f"synthetic dag:{num_nodes}:{seed}"})
    names: list[str] = []

    def layer(inputs: Sequence[str]) -> str:
        name = f"n{len(names)}"
        _add_layer(g, rng, name, list(dict.fromkeys(inputs)))
        names.append(name)
        return name

    last = layer([]) if num_nodes else ""
    while len(names) < num_nodes:
        left, kind = num_nodes - len(names), rng.random()
        if kind < 0.3 and left >= 3:
            x = last
            for _ in range(rng.randint(2, min(4, left - 1))):
                x = layer([x])
            last = layer([x, last])
        elif kind < 0.6 and left >= 3:
            ends, budget = [], left - 1
            for _ in range(rng.randint(2, 3)):
                length = min(rng.randint(1, 3), budget)
                if not length:
                    break
                x = last
                for _ in range(length):
                    x = layer([x])
                budget -= length
                ends.append(x)
            last = layer(ends)
        else:
            skip = [rng.choice(names[-16:])] if len(names) > 2 and rng.random() < 0.2 else []
            last = layer([last, *skip])
    return g


def _pipedream_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / "graph.txt").is_file():
        return [path / "graph.txt"]
    return sorted(path.glob("*/graph.txt"))


def _model_costs(spec_text: str, analytic: bool) -> CostGraph:
    from pdcompile.capture.model_spec import load_model_spec
    from pdcompile.capture.tracing import trace
    from pdcompile.compiling.analysis import analyze

    spec = load_model_spec(spec_text)
    gm = trace(spec.model, spec.example_inputs, example_kwargs=spec.example_kwargs)
    return analyze(gm, spec.example_inputs, example_kwargs=spec.example_kwargs,
                   profile=not analytic, progress=False)  # fmt: skip


def load_instance(text: str, *, analytic: bool = True) -> list[Instance]:
    """The instances an INPUT names.

    Args:
        text: `chain:N[:SEED]` or `dag:N[:SEED]` (seed 0 by default); a PipeDream `graph.txt`,
            a folder holding one, or a folder of such folders (one instance each); a CostGraph
            `.json`; or a model spec `package.module:factory` / `file.py:factory`.
        analytic: model specs are priced on the device model instead of profiled.

    Raises:
        SpecError: the input is none of these, a named file or folder does not exist, or a
            graph has no nodes.
        CostError: a cost file is malformed.
    """
    instances = _read_instance(text, analytic)
    for instance in instances:
        if not instance.cost_graph.nodes:
            raise SpecError(f"input {text!r}: {instance.source} has no nodes; nothing to plan")
    return instances


def _read_instance(text: str, analytic: bool) -> list[Instance]:
    synthetic = _SYNTHETIC.match(text)
    if synthetic:
        kind, size, seed = synthetic.group(1), int(synthetic.group(2)), int(synthetic.group(3) or 0)
        if size < 1:
            raise SpecError(f"synthetic instance {text!r}: give at least one node, e.g. {kind}:100")
        make = synthetic_chain if kind == "chain" else synthetic_dag
        return [Instance(text, make(size, seed), "synthetic")]
    path = Path(text)
    if path.suffix == ".json" and path.exists():  # CostGraph.load names a FIFO or a folder
        return [Instance(path.stem, CostGraph.load(path), str(path))]
    if path.exists():
        files = _pipedream_files(path)
        if not files:
            raise SpecError(f"input {text!r}: no graph.txt in this folder or its subfolders")
        return [Instance(f.parent.name, CostGraph.from_pipedream(f), str(f)) for f in files]
    if path.suffix in (".json", ".txt") or ":" not in text:
        raise SpecError(
            f"input {text!r}: no such file or folder; give a PipeDream profile (graph.txt or its "
            "folder), a CostGraph .json, a model spec package.module:factory, or chain:N / dag:N"
        )
    return [Instance(text, _model_costs(text, analytic), text)]


def load_instances(texts: Sequence[str], *, analytic: bool = True) -> list[Instance]:
    """`load_instance` over every INPUT; a repeated name gets a suffix (`vgg16 (2)`)."""
    instances, seen = [], dict[str, int]()
    for text in texts:
        for instance in load_instance(text, analytic=analytic):
            seen[instance.name] = seen.get(instance.name, 0) + 1
            if seen[instance.name] > 1:
                instance = Instance(f"{instance.name} ({seen[instance.name]})",
                                    instance.cost_graph, instance.source)  # fmt: skip
            instances.append(instance)
    return instances

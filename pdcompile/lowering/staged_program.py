"""`StagedProgram`: the stage modules of a plan, the channels between them and the tie groups.

`pdcompile.lowering` makes one; `StagedProgram.load` rebuilds one from the files `write_source`
wrote. Calling it runs the stages one after another in this process, passing every value through
its channel: the reference the pipelined runtime is checked against.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from pdcompile.core.errors import CodegenError
from pdcompile.core.ir import accept_constants
from pdcompile.core.text import human_bytes
from pdcompile.passes.planning.plans import Plan

BATCH = "batch"  # the symbol of the batch dimension in channel shapes
_DIM = re.compile(r"^(?:(\d+)\*)?batch(?:([+-]\d+))?$")


def batch_dim(scale: int, offset: int) -> str:
    """The symbolic size `scale * batch + offset`, written as `channel.shape` shows it."""
    text = BATCH if scale == 1 else f"{scale}*{BATCH}"
    return text if offset == 0 else f"{text}{offset:+d}"


@dataclass(frozen=True)
class Channel:
    """One value sent from one stage to another, once per minibatch.

    `kind` is "tensor" (with `shape`, where a symbolic size such as "batch" or "16*batch" scales
    with the microbatch, `dtype`, and `requires_grad`: whether a gradient comes back) or "value":
    small metadata such as an int, a shape or a device (`value_type` names its Python type).
    """

    src_stage: int
    dst_stage: int
    name: str
    kind: str = "tensor"
    shape: tuple[int | str, ...] = ()
    dtype: str = ""
    requires_grad: bool = False
    value_type: str = ""

    def shape_for(self, batch_size: int) -> tuple[int, ...]:
        """The concrete shape for a microbatch of `batch_size` rows."""
        dims = []
        for dim in self.shape:
            if isinstance(dim, int):
                dims.append(dim)
                continue
            match = _DIM.match(dim)
            if match is None:
                raise CodegenError(
                    f"channel {self.name!r} (stage {self.src_stage} -> {self.dst_stage}): cannot "
                    f"read dimension {dim!r}; a size is an integer or 'batch', 'k*batch', "
                    "'k*batch+c' (write the program again with StagedProgram.write_source)"
                )
            scale, offset = match.groups()
            dims.append(int(scale or 1) * batch_size + int(offset or 0))
        return tuple(dims)

    def describe(self) -> str:
        """`float32[batch, 16, 64]` for a tensor, `value torch.Size` for metadata."""
        if self.kind == "tensor":
            return f"{self.dtype}[{', '.join(map(str, self.shape))}]"
        return f"value {self.value_type}"

    def __str__(self) -> str:
        grad = ", grad" if self.requires_grad else ""
        return f"{self.src_stage} -> {self.dst_stage} {self.name}: {self.describe()}{grad}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Channel:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class TieGroup:
    """A parameter or buffer that nodes of several stages use (under one or several names).

    The owning stage holds the original tensor; every other stage in `stages` holds a copy, and
    the runtime keeps the copies equal (for gradients: sums them). Within a stage a tied tensor
    is one tensor under all of its names.
    """

    names: tuple[str, ...]
    owner: int
    stages: tuple[int, ...]

    @property
    def copies(self) -> tuple[int, ...]:
        """The stages holding a copy."""
        return tuple(s for s in self.stages if s != self.owner)

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "owner": self.owner, "stages": list(self.stages)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TieGroup:
        return cls(tuple(data["names"]), data["owner"], tuple(data["stages"]))


@dataclass(frozen=True)
class StageSignature:
    """What a stage takes and gives: value names (the captured graph's node names).

    Stage 0 takes the graph inputs; every other stage takes what its channels bring, as keyword
    arguments. A stage before the last returns a dict of the values it sends; the last returns
    what the model returns. `nodes` are the graph nodes the stage computes, `tensors` the names
    of the model's parameters and buffers it holds (every name of a tied one).
    """

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]
    tensors: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSignature:
        return cls(data["index"], *(tuple(data[k]) for k in ("inputs", "outputs", "nodes",
                                                              "tensors")))  # fmt: skip


class StagedProgram:
    """One module per pipeline stage, with the channels and tie groups that connect them.

    Attributes:
        stages: the stage modules (GraphModules), in pipeline order.
        signatures: per stage, its inputs, outputs and nodes.
        channels: every value that crosses a stage boundary, once per destination stage.
        ties: tensors used by several stages.
        plan: the plan the stages come from (its predicted costs are in the written source).
        input_specs: the graph inputs and their shapes (`int64[batch, 16]`), which stage 0 takes.
        constants: the constant arguments the model was captured with, `(name, repr(value))`:
            a call may pass them again by keyword, with the same value.
        model_name, training: the captured model's class name and mode.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        signatures: Sequence[StageSignature],
        channels: Sequence[Channel],
        ties: Sequence[TieGroup],
        *,
        plan: Plan,
        input_specs: Mapping[str, str],
        model_name: str,
        training: bool,
        constants: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.stages = list(stages)
        self.signatures = tuple(signatures)
        self.channels = tuple(channels)
        self.ties = tuple(ties)
        self.plan = plan
        self.input_specs = dict(input_specs)
        self.model_name = model_name
        self.training = training
        self.constants = tuple(constants)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def channels_from(self, stage: int) -> tuple[Channel, ...]:
        return tuple(c for c in self.channels if c.src_stage == stage)

    def channels_to(self, stage: int) -> tuple[Channel, ...]:
        return tuple(c for c in self.channels if c.dst_stage == stage)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run every stage in order in this process; returns what the captured model returns.

        Args are the graph inputs, as for the captured GraphModule (by position or by name),
        and the constants it was captured with (by name, same value).
        """
        kwargs = accept_constants(self.constants, kwargs, self.model_name)
        inbox: list[dict[str, Any]] = [{} for _ in self.stages]
        last = self.num_stages - 1
        for index, stage in enumerate(self.stages):
            result = stage(*args, **kwargs) if index == 0 else stage(**inbox[index])
            if index == last:
                return result
            for channel in self.channels_from(index):
                inbox[channel.dst_stage][channel.name] = result[channel.name]
        raise AssertionError("a program has at least one stage")

    def __str__(self) -> str:
        rows = [("stage", "nodes", "inputs", "outputs", "parameters", "tied")]
        for sig, stage in zip(self.signatures, self.stages, strict=True):
            tensors = {id(t): t for t in [*stage.parameters(), *stage.buffers()]}
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            tied = [", ".join(t.names) for t in self.ties if sig.index in t.stages]
            rows.append((
                str(sig.index), str(len(sig.nodes)), str(len(sig.inputs)),
                str(len(sig.outputs)) if sig.index < self.num_stages - 1 else "model output",
                f"{len(tensors)} ({human_bytes(size)})", "; ".join(tied) or "-",
            ))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"StagedProgram of {self.model_name}: {self.num_stages} stages, "
            f"{len(self.channels)} channels, {len(self.ties)} tie group(s)"
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines += [f"  {c}" for c in self.channels]
        return "\n".join(lines)

    def write_source(self, directory: str | Path) -> Path:
        """Write `stage_<i>.py` per stage and `program.json` into `directory` (created).

        Returns:
            The directory.

        Raises:
            CodegenError: a stage calls a function that cannot be imported by name.
        """
        # imported here: stage_source builds StagedPrograms, so it imports this module
        from pdcompile.lowering.stage_source import write_program

        return write_program(self, Path(directory))

    @classmethod
    def load(cls, directory: str | Path, model: nn.Module) -> StagedProgram:
        """Rebuild a program from the files `write_source` wrote, without pickle.

        Args:
            directory: the folder with `program.json` and the stage sources.
            model: the original model, in the mode it was captured in; it supplies the leaf
                modules and the parameters and buffers (shared, as in `codegen`).

        Raises:
            CodegenError: the files are missing or malformed, or do not fit `model`.
        """
        from pdcompile.lowering.stage_source import load_program

        return load_program(Path(directory), model)

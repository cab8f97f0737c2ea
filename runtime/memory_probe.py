"""What a rank really holds while it trains: the memory probe, against the simulator's model.

Off by default; `attach(pipeline)` (or `PipelinedModule.measure_memory(True)`) gives each rank of
the pipeline in this process a `MemoryProbe` that its stage workers report to (one attribute test
per action when off). Per rank, over all its stages, it follows:

- **saved activations**: every tensor autograd saves for a backward while a stage runs its
  forward (and the last stage its loss), through `torch.autograd.graph.saved_tensors_hooks`.
  Each storage counts once per rank (views share it); the stage's parameters, buffers and weight
  copies are not activations. The hook's packed object lives exactly as long as autograd keeps
  the saved tensor, so the release is observed, not assumed: at the end of the microbatch's
  backward, or of its W for a split backward. A view of the step's batch (stage 0's inputs, the
  last stage's targets) counts at the microbatch's own bytes: every microbatch shares the
  caller's batch, which the caller holds anyway.
- **parameters, buffers, gradients** (of the live weights and of the weight copies) and
  **optimizer state**: from the live modules and optimizers.
- **weight versions**: `pipedream`'s stashed copies and `2bw`'s previous weights
  (`WeightVersions.copies`).
- **message buffers**: receives posted early and sends not known complete
  (`DistributedComm.buffer_bytes`), and received stage inputs (with their gradients) the worker
  keeps for the gradients it sends back, where autograd did not save them. Reported beside the
  total: the simulator's model counts what the runtime keeps of them (`IN_USE` per message
  size, `Simulation.message_memory`) in `Plan.rank_memory`, apart from what the parts are compared
  with (`Simulation.held_memory`).

The total (parameters + buffers + gradients + optimizer state + versions + saved activations)
is taken after every action and at every save and release of an activation; its peak is kept
with its parts. Where the rank computes on CUDA, `torch.cuda.max_memory_allocated` adds the
allocator's peak, transients included. On the CPU the transients inside one forward or backward
(temporaries autograd does not save, gradients on their way) are not measured.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdcompile.core.text import human_bytes

if TYPE_CHECKING:
    from pdcompile.passes.planning.plans import Plan, Stage
    from pdcompile.runtime.pipeline import Pipeline
    from pdcompile.runtime.worker import StageWorker

__all__ = ["MemoryParts", "MemoryProbe", "RankMemory", "attach", "compare", "detach"]

MEASURED = "parameters, buffers, gradients, optimizer state, weight versions, saved activations"
CPU_UNMEASURED = "transients inside a forward or backward (CUDA's allocator peak measures them)"


@dataclass(frozen=True)
class MemoryParts:
    """Bytes a rank holds, by part."""

    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer: int = 0
    versions: int = 0  # weight copies (stashed versions, 2bw's previous weights)
    activations: int = 0  # saved for backwards in flight

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    @property
    def weights(self) -> int:
        """What the model's `weight_bytes` counts: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        return (
            f"params {human_bytes(self.params)}, grads {human_bytes(self.grads)}, optimizer "
            f"{human_bytes(self.optimizer)}, versions {human_bytes(self.versions)}, activations "
            f"{human_bytes(self.activations)}, buffers {human_bytes(self.buffers)}"
        )


@dataclass(frozen=True)
class RankMemory:
    """One rank's measured memory.

    `peak` holds the parts at the moment their total peaked, `stage_activations` the saved
    activations per stage then; `step_peaks` the peak of each `train_step` call; `messages` the
    peak of the message buffers (not in the total); `cuda_peak` the CUDA allocator's peak over
    the steps measured (None on the CPU; in one process running several ranks it is the
    process's).
    """

    rank: int
    stages: tuple[int, ...]
    peak: MemoryParts
    stage_activations: dict[int, int]
    step_peaks: tuple[int, ...]
    messages: int
    cuda_peak: int | None


class _Saved:
    """What the pack hook returns: the saved tensor, detached (a saved output that kept its
    grad_fn would make a reference cycle that outlives the backward), and the release of its
    bytes when autograd drops it. The probe is held weakly: autograd's graph (C++, which the
    garbage collector does not see) would otherwise keep the probe, its workers and their
    comm alive while a microbatch is in flight, however unreachable the pipeline."""

    __slots__ = ("key", "probe", "tensor")

    def __init__(self, tensor: torch.Tensor, probe: MemoryProbe, key: Any) -> None:
        self.tensor, self.probe, self.key = tensor, weakref.ref(probe), key

    def __del__(self) -> None:
        probe = self.probe()
        if probe is not None:
            probe.release(self.key)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class MemoryProbe:
    """One rank's measurement (its stage workers report to it: `worker.probe`)."""

    def __init__(self, rank: int, workers: list[StageWorker]) -> None:
        self.rank = rank
        self.workers = sorted(workers, key=lambda w: w.stage)
        self.comm = self.workers[0].comm
        self.device = next(
            (p.device for w in self.workers for p in w.module.parameters()), torch.device("cpu")
        )
        self.held: dict[Any, list[int]] = {}  # storage key -> [saves alive, bytes, stage]
        self.activations = 0
        self.by_stage = {w.stage: 0 for w in self.workers}
        self.static = MemoryParts()  # everything but the activations, as last taken
        self.peak = MemoryParts()
        self.stage_activations = dict(self.by_stage)
        self.step_peak = 0
        self.step_peaks: list[int] = []
        self.messages = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()

    # -- what the workers call ---------------------------------------------------------------

    @contextmanager
    def saving(self, worker: StageWorker, microbatch: int) -> Iterator[None]:
        """Around a forward (and loss) of `worker`: count what autograd saves."""
        excluded = {_key(t) for t in [*worker.params.values(), *worker.module.buffers()]}
        for copy in worker.versions.copies.values():
            excluded.update(_key(t) for t in copy.values())
        mb = worker.data.get(microbatch)
        batch = {}  # a view of the step's batch: its own bytes, per microbatch
        if mb is not None:
            for t in _tensors((mb.args, mb.kwargs, mb.target)):
                batch[_key(t)] = t.numel() * t.element_size()
        stage = worker.stage
        # autograd keeps the hook with each save, in C++ where the garbage collector does not
        # see it: a strong reference would keep the probe and its workers alive (`_Saved`)
        probe = weakref.ref(self)

        def pack(tensor: torch.Tensor) -> Any:
            me, key = probe(), _key(tensor)
            if me is None or key in excluded:
                return tensor
            nbytes = batch.get(key)
            if nbytes is None:
                nbytes = tensor.untyped_storage().nbytes()
            else:
                key = (key, microbatch)
            entry = me.held.get(key)
            if entry is None:
                me.held[key] = [1, nbytes, stage]
                me.activations += nbytes
                me.by_stage[stage] += nbytes
                me._check()
            else:
                entry[0] += 1
            return _Saved(tensor.detach(), me, key)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def release(self, key: Any) -> None:
        """Autograd dropped one save of `key`'s storage."""
        entry = self.held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.held[key]
            self.activations -= entry[1]
            self.by_stage[entry[2]] -= entry[1]
            # gradients appear during the backward that frees the activations
            self.static = dataclasses.replace(self.static, grads=self._grads())

    def sample(self) -> None:
        """After an action: take every part again."""
        params, buffers, optimizer, versions = [], [], [], []
        for w in self.workers:
            params += w.params.values()
            buffers += w.module.buffers()
            for state in w.optimizer.state.values():
                optimizer += _tensors(state)
            for copy in w.versions.copies.values():
                versions += copy.values()
        self.static = MemoryParts(
            params=_storage_bytes(params), buffers=_storage_bytes(buffers),
            grads=self._grads(), optimizer=_storage_bytes(optimizer),
            versions=_storage_bytes(versions),
        )  # fmt: skip
        self._check()
        self.messages = max(self.messages, self._message_bytes())

    def end_step(self) -> None:
        """A `train_step` call ended: its peak is kept."""
        self.step_peaks.append(self.step_peak)
        self.step_peak = 0

    def report(self) -> RankMemory:
        cuda = None
        if self.device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(self.device)
        return RankMemory(
            rank=self.rank, stages=tuple(w.stage for w in self.workers), peak=self.peak,
            stage_activations=dict(self.stage_activations), step_peaks=tuple(self.step_peaks),
            messages=self.messages, cuda_peak=cuda,
        )  # fmt: skip

    # -- internals ---------------------------------------------------------------------------

    def _grads(self) -> int:
        grads = []
        for w in self.workers:
            grads += (p.grad for p in w.params.values() if p.grad is not None)
            for copy in w.versions.copies.values():
                grads += (t.grad for t in copy.values() if t.grad is not None)
        return _storage_bytes(grads)

    def _check(self) -> None:
        total = self.static.total + self.activations
        self.step_peak = max(self.step_peak, total)
        if total > self.peak.total:
            self.peak = dataclasses.replace(self.static, activations=self.activations)
            self.stage_activations = dict(self.by_stage)

    def _message_bytes(self) -> int:
        """Comm buffers, and received inputs (with their gradients) kept for the gradients
        sent back where autograd did not save them."""
        comm = getattr(self.comm, "buffer_bytes", 0)
        kept = []
        for w in self.workers:
            for state in w.flight.values():
                for t in _tensors(state.inputs):
                    if _key(t) not in self.held:
                        kept.append(t)
                    if t.grad is not None:
                        kept.append(t.grad)
        return comm + _storage_bytes(kept)


def device_memory(memory: Any, device: torch.device, num_devices: int) -> Any:
    """`memory="auto"` on `device` (`compile` plans with it): CUDA's total memory, else the
    host's available RAM over the ranks on it (`LOCAL_WORLD_SIZE`, as torchrun sets it, else
    all `num_devices`), less the margin (`search.recompute_choice.host_memory`); any other
    value as given."""
    if memory != "auto":
        return memory
    from pdcompile.passes.planning.recompute_choice import host_memory

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return host_memory(int(os.environ.get("LOCAL_WORLD_SIZE", num_devices)), total)


def attach(pipeline: Pipeline) -> dict[int, MemoryProbe]:
    """Measure the memory of every rank this process runs: a probe per rank, by rank."""
    probes = {}
    for rank, workers in pipeline.ranks.items():
        probes[rank] = probe = MemoryProbe(rank, list(workers))
        for worker in workers:
            worker.probe = probe
    return probes


def detach(pipeline: Pipeline) -> None:
    for worker in pipeline.workers.values():
        worker.probe = None


@dataclass(frozen=True)
class RankComparison:
    """A rank's measured peak against the simulated one (`Plan.rank_memory`), with the model's
    parts: `weights` (parameters, gradients, optimizer state of its stages: `weight_bytes`) and
    the rest, in flight (activations and weight copies) at the simulated peak; `stages` the
    model's stages of the rank. `held` is the simulated peak without what a recomputing
    backward holds inside it only (`Simulation.held_memory`), which the probe's parts do not
    see (CUDA's allocator peak does): the figure they are compared with."""

    rank: int
    measured: RankMemory
    predicted: int
    weights: int
    stages: tuple[Stage, ...] = ()
    held: int | None = None

    @property
    def comparable(self) -> int:
        return self.predicted if self.held is None else self.held

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted, predicted as the probe sees it (`held`)."""
        expected = self.comparable
        return self.measured.peak.total / expected - 1 if expected else float("inf")

    def describe(self) -> str:
        m = self.measured
        inside = self.predicted - self.comparable
        recomputed = (
            f" (of which {human_bytes(inside)} only inside a recomputing backward, not measured "
            "by the parts)" if inside else ""
        )  # fmt: skip
        lines = [
            f"memory measured {human_bytes(m.peak.total)} against predicted "
            f"{human_bytes(self.comparable)} ({self.error:+.1%})",
            f"  measured at its peak: {m.peak.describe()}",
            f"  predicted: weights {human_bytes(self.weights)} (params, grads, optimizer), in "
            f"flight {human_bytes(self.comparable - self.weights)} (activations, weight copies, "
            "less the gradients before the first backward)",
            f"  predicted peak {human_bytes(self.predicted)}{recomputed}",
            f"  message buffers in use, peak {human_bytes(m.messages)} (apart from the parts; "
            "the model counts 8 per message size in its peak)",
        ]
        lines += [
            f"  stage {s.index}: predicted peak {human_bytes(s.memory_bytes)} (weights "
            f"{human_bytes(s.weight_bytes)}, activations {human_bytes(s.activation_bytes)} per "
            f"microbatch{_recomputed(s)}, a weight copy {human_bytes(s.param_bytes)}); measured "
            f"activations at the rank's peak {human_bytes(m.stage_activations.get(s.index, 0))}"
            for s in self.stages
        ]
        if m.cuda_peak is not None:
            lines.append(f"  CUDA allocator peak {human_bytes(m.cuda_peak)} (transients included)")
        else:
            lines.append(f"  on the CPU, measured: {MEASURED}; not measured: {CPU_UNMEASURED}")
        return "\n".join(lines)


def _recomputed(stage: Stage) -> str:
    if not stage.recompute:
        return ""
    return f" kept while recomputing, {human_bytes(stage.recompute_bytes)} inside its backward"


def compare(plan: Plan, measured: dict[int, RankMemory]) -> dict[int, RankComparison]:
    """Each measured rank against the plan's simulated peak (`rank_memory[r]`), and that peak
    without what a recomputing backward holds inside it (`RankComparison.held`)."""
    from pdcompile.passes.planning.simulator import simulate

    held = simulate(plan).held_memory if plan.rank_memory else []
    out = {}
    for rank, memory in measured.items():
        predicted = plan.rank_memory[rank] if rank < len(plan.rank_memory) else 0
        stages = tuple(plan.stages[s] for s in memory.stages)
        weights = sum(s.weight_bytes for s in stages)
        within = held[rank] if rank < len(held) else None
        out[rank] = RankComparison(rank, memory, predicted, weights, stages, within)
    return out

"""`PipelinedModule`: what `pdcompile.compile` returns: train, evaluate, inspect, checkpoint."""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.core.errors import CheckpointError, PdcompileError
from pdcompile.core.text import human_bytes, human_seconds
from pdcompile.passes.planning.evaluation import rescore
from pdcompile.passes.planning.microbatch_count import counts_table
from pdcompile.passes.planning.plan_words import step_warning
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.recompute_choice import recompute_table
from pdcompile.passes.planning.schedule_choice import auto_table
from pdcompile.passes.planning.timeline import Event, to_chrome_trace
from pdcompile.pictures.gantt import bubble_fraction
from pdcompile.runtime import memory_probe
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.microbatches import batch_rows
from pdcompile.runtime.pipeline import Pipeline
from pdcompile.scheduling.action_kinds import ALLREDUCE, CLIP, COMPUTE, RECV, SEND, STEP, kind

log = logging.getLogger(__name__)

_KEEP_STEPS = 1000  # measured steps kept for explain()
_KEEP_ACTIONS = 50 * _KEEP_STEPS  # recorded actions kept per rank for explain() and save_trace()


class PipelinedModule:
    """A model cut into pipeline stages, trained by the ranks of a job (or all in this process).

    Every rank calls `train_step` with the same global batch; stage 0 uses the inputs, the last
    stage the targets; every rank gets the loss back.
    """

    def __init__(
        self, pipeline: Pipeline, *, rank: int, replanner: Any = None, checkpoint: Any = None
    ) -> None:
        self.pipeline = pipeline
        self.rank = rank
        self.steps = 0  # train steps so far (restored by load(): a resumed job's data position)
        self.replanner = replanner  # `closed_loop.move.Replanner` (compile(replan=...)), or None
        # `runtime.auto_resume.AutoCheckpoint` (compile(checkpoint_dir=...)), or None
        self.checkpoint = checkpoint
        self.resumed_from: str | None = None  # the checkpoint resume() loaded
        # the plan the last loaded checkpoint was saved running, and the step its job moved to
        # it (closed loop; None: it had not moved); resuming moves onto it (closed_loop.move)
        self.saved_plan: Plan | None = None
        self.saved_moved_at: int | None = None
        self.resumed_note: str | None = None  # how resuming chose the plan, for explain()
        self._scored: Plan | None = None  # the plan re-scored at the rows the first step ran
        # per step: perf_counter at its start, seconds, rows
        self._measured: deque[tuple[float, float, int]] = deque(maxlen=_KEEP_STEPS)
        self._probes: dict[int, memory_probe.MemoryProbe] = {}  # measure_memory(True)
        self.restarted()

    def restarted(self) -> None:
        """Start recording anew on `self.pipeline` (built here, or by a re-plan's move)."""
        self._scored = None
        for worker in self.pipeline.workers.values():
            worker.timeline = []
        if self._probes:  # a move built new workers: measure them from here on
            self._probes = memory_probe.attach(self.pipeline)

    def step_start(self, step: int) -> float:
        """When train step `step` (counted from 0) started, in `perf_counter` seconds (-inf
        for one no longer recorded)."""
        back = self.steps - step
        return self._measured[-back][0] if 0 < back <= len(self._measured) else float("-inf")

    @property
    def plan(self) -> Plan:
        """The plan, re-scored (same partition) for the rows per microbatch the first
        `train_step` ran, so its predictions compare with what is measured."""
        return self._scored or self.pipeline.program.plan

    @property
    def stage(self) -> int | None:
        """This rank's stage (None where this process runs several: a single process runs
        every stage, and with chunks a rank runs several)."""
        stages = {w.stage for w in self.pipeline.workers.values()}
        return stages.pop() if len(stages) == 1 else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a NaN or infinite loss (`nonfinite="skip"`; the same on every
        rank)."""
        return max(w.skipped for w in self.pipeline.workers.values())

    def train_step(self, inputs: Any, targets: Any, kwargs: dict | None = None) -> float:
        """One step on a batch (a tensor or a tuple of positional inputs); returns the loss (NaN
        or infinite for a step `nonfinite="skip"` skipped)."""
        args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        start = time.perf_counter()
        loss = self.pipeline.train_step(args, targets, kwargs)
        for probe in self._probes.values():
            probe.end_step()
        rows = batch_rows(args, kwargs, self.pipeline.input_dims)
        self._measured.append((start, time.perf_counter() - start, rows))
        if self._scored is None:
            planned = self.pipeline.program.plan
            size = max(1, rows // self.pipeline.num_microbatches)
            same = size == planned.microbatch_size or not planned.microbatch_size
            self._scored = planned if same else rescore(planned, microbatch_size=size)
        self.steps += 1
        for worker in self.pipeline.workers.values():  # bounded memory
            del worker.timeline[:-_KEEP_ACTIONS]
        if self.replanner is not None and self.replanner.due(self.steps):
            self.replanner.run(self)
        if self.checkpoint is not None and self.checkpoint.due(self.steps):
            self.checkpoint.save(self.save, self.steps, self.rank)
        return loss

    def resume(self) -> str | None:
        """Load the newest valid checkpoint of `compile(checkpoint_dir=...)` (every rank calls
        it; `compile` does); returns its path, or None when the folder holds none. `steps`
        then counts on from the checkpoint's: feed the batches from there.

        Example:
            >>> pipe = pdcompile.compile(model, (x,), ..., checkpoint_dir="ckpt",
            ...                          checkpoint_every=100)  # resumes by itself
            >>> for step in range(pipe.steps, total_steps):
            ...     pipe.train_step(*batch(step))
        """
        if self.checkpoint is None:
            raise CheckpointError(
                "resume() loads from compile(checkpoint_dir=...), which was not given; load a "
                "checkpoint by path with load(dir)"
            )
        if len(self.pipeline.workers) != 1:
            raise CheckpointError(
                f"compile(checkpoint_dir=...) checkpoints one stage per process (torchrun, one "
                f"rank per stage); this process runs {len(self.pipeline.workers)} stage "
                "replicas: leave checkpoint_dir out and save with state_dict(), or run one rank "
                "per stage"
            )
        self.resumed_from = self.checkpoint.resume(self.load)
        return self.resumed_from

    def eval_step(self, inputs: Any, kwargs: dict | None = None) -> Any:
        """The model's outputs for a batch, without gradients (flushes first); on the rank
        holding the last stage's first replica, None on the others."""
        args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        return self.pipeline.eval_step(args, kwargs)

    def measure_memory(self, on: bool = True) -> None:
        """Measure what each rank of this process holds from the next action on (off by
        default: the workers then pay one attribute test per action): parameters, gradients,
        optimizer state, weight versions and saved activations, with the peak of their sum per
        rank (`runtime/memory_probe.py`). `explain()` then shows it against the plan's
        `rank_memory`. Switching it on again starts the measurement afresh.

        Example:
            >>> pipe.measure_memory()
            >>> pipe.train_step(x, y)
            >>> pipe.measured_memory[0].peak.total  # bytes
            132608
        """
        memory_probe.detach(self.pipeline)
        self._probes = memory_probe.attach(self.pipeline) if on else {}

    @property
    def measured_memory(self) -> dict[int, memory_probe.RankMemory]:
        """Per rank of this process, what the memory probe measured so far ({} when off)."""
        return {rank: probe.report() for rank, probe in self._probes.items()}

    def flush(self) -> None:
        """Complete the microbatches in flight (`pipedream`, `2bw`)."""
        self.pipeline.flush()

    def close(self) -> None:
        """Complete the microbatches in flight and release the process groups the pipeline
        made (every rank calls it; also at the end of a `with` block). The parameters stay
        readable (`state_dict`); training needs a new `compile`."""
        self.pipeline.close()

    def __enter__(self) -> PipelinedModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def version(self, stage: int, minibatch: int) -> int:
        """The number of updates of `stage` in the weights minibatch `minibatch` (counted from
        the last flush for `pipedream`, over the whole run otherwise) runs on."""
        replicas = [s.replicas for s in self.plan.stages]
        return self.pipeline.rules.version(
            replicas, stage, minibatch, self.pipeline.num_microbatches
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's slice of the original model's state dict (original names; every
        stage in a single process). Flushes first."""
        self.flush()
        state: dict[str, torch.Tensor] = {}
        for worker in self.pipeline.workers.values():
            for name, tensor in worker.module.state_dict().items():
                state.setdefault(name, tensor)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this process's slice from a state dict of the original model (strict: every
        tensor the stage holds must be there)."""
        self.flush()
        for worker in self.pipeline.workers.values():
            names = worker.module.state_dict().keys()
            missing = [n for n in names if n not in state]
            if missing:
                raise CheckpointError(
                    f"the state dict lacks {len(missing)} tensors stage {worker.stage} holds, "
                    f"e.g. {missing[:5]}; pass the original model's whole state dict (original "
                    "names, e.g. from pdcompile.load_full_state_dict)"
                )
            worker.module.load_state_dict({n: state[n] for n in names})

    def save(self, directory: str) -> None:
        """Checkpoint this rank's stage with torch.distributed.checkpoint (every rank calls
        it). Flushes first, and records the step count, the updates, the RNG states (and
        2bw's previous weights), so that a resumed run equals one that flushed here. Atomic:
        a checkpoint already in `directory` stays whole until the new one replaces it."""
        from pdcompile.runtime.checkpoint import rng_state, save
        from pdcompile.runtime.checkpoint_entries import state_entries

        worker = self._only_worker("save")
        self.flush()
        extra: dict[str, Any] = {
            "steps": self.steps,
            "updates": worker.versions.updates,
            **rng_state(),
        }
        extra.update({f"shadow/{n}": t.detach() for n, t in worker.versions.previous.items()})
        extra.update(self._plan_entries(worker))
        if worker.scheduler is not None:
            extra.update(state_entries(worker.scheduler.state_dict(), "scheduler"))
        save(
            directory, model=worker.module, optimizer=worker.optimizer, extra=extra,
            step=self.steps, timeout_s=self._timeout_s(),
        )  # fmt: skip

    def load(self, directory: str) -> None:
        """Load this rank's stage from a checkpoint, whatever plan or world size saved it
        (every rank calls it); restores the counters and RNG states when the world size is the
        same."""
        from pdcompile.runtime.checkpoint import load, set_rng_state
        from pdcompile.runtime.checkpoint_entries import restore_state

        worker = self._only_worker("load")
        self.flush()
        extra = load(
            directory, model=worker.module, optimizer=worker.optimizer, timeout_s=self._timeout_s()
        )
        set_rng_state(extra)
        self.steps = int(extra.get("steps", self.steps))
        worker.versions.updates = int(extra.get("updates", worker.versions.updates))
        worker.skipped = int(extra.get("skipped", worker.skipped))
        self.saved_plan = _saved_plan(extra, directory)
        moved = int(extra.get("moved_at", -1))
        self.saved_moved_at = moved if moved >= 0 else None
        if worker.scheduler is not None:
            state = worker.scheduler.state_dict()
            worker.scheduler.load_state_dict(restore_state(state, extra, "scheduler"))
        self.pipeline.restart()
        shadow = {k.removeprefix("shadow/"): t for k, t in extra.items() if k.startswith("shadow/")}
        worker.versions.restore_previous(shadow)

    def _plan_entries(self, worker: Any) -> dict[str, Any]:
        """What a checkpoint records of the plan running: its JSON (bytes), the steps skipped
        for a non-finite loss, and the step the closed loop moved to it after (-1: none)."""
        text = self.pipeline.program.plan.to_json().encode()
        moved = self.replanner.moved_at if self.replanner is not None else None
        moved = self.saved_moved_at if moved is None else moved
        return {
            "plan": torch.frombuffer(bytearray(text), dtype=torch.uint8),
            "skipped": worker.skipped,
            "moved_at": -1 if moved is None else moved,
        }

    def _timeout_s(self) -> float | None:
        """The step timeout, which bounds a save's or load's waits too (None: one process)."""
        comm = getattr(self.pipeline, "comm", None)
        return None if comm is None else comm.timeout_s

    def _only_worker(self, what: str) -> Any:
        if len(self.pipeline.workers) != 1:
            raise PdcompileError(
                f"{what}() checkpoints one rank per process, running one stage (torchrun); "
                f"this process runs {len(self.pipeline.workers)} stage replicas: use "
                "state_dict() / load_state_dict(), or pdcompile.load_full_state_dict"
            )
        return next(iter(self.pipeline.workers.values()))

    def explain(self) -> str:
        """The plan (opening with its sentence, `plan_words.describe`, and with its notes, e.g.
        on microbatches split unevenly over a stage's replicas), what the schedule means for
        the optimisation, the measured median step against the predicted one (a warning past
        1.5x either way, `plan_words.step_warning`), and so far per rank its measured bubble
        (over all its stages) against the simulated one, its peak memory, and each of its
        stages' measured times against the predicted ones."""
        rules = self.pipeline.rules
        lines = [str(self.plan), "", f"schedule {rules.name}: {rules.meaning}", ""]
        # planned with schedule="auto": how the others compared; with global_batch_size alone:
        # the microbatch counts
        comparison = auto_table(self.plan) or counts_table(self.plan)
        if comparison:
            lines += [comparison, *self._rescored_note(), ""]
        recomputed = recompute_table(self.plan)  # which stages recompute, what it costs
        if recomputed:
            lines += [recomputed, ""]
        lines += [self.resumed_note, ""] if self.resumed_note else []
        lines += self._explain_replan()
        fused = {w.stage: w.fused for w in self.pipeline.workers.values() if w.fused}
        lines += [  # a split backward (zb-*) falls back where a stage cannot split (worker.py)
            f"stage {stage} runs its backward fused, not split into I and W: {why}"
            for stage, why in sorted(fused.items())
        ] + ([""] if fused else [])
        if self._measured:
            seconds = sorted(s for _, s, _ in self._measured)[len(self._measured) // 2]
            rows = sum(r for _, _, r in self._measured) / len(self._measured)
            lines.append(
                f"measured over {len(self._measured)} steps: median {human_seconds(seconds)} "
                f"per step, {rows / seconds:.1f} samples/s (predicted step "
                f"{human_seconds(self.plan.step_time)})"
            )
            warning = step_warning(self.plan.step_time, seconds)
            lines += [warning] if warning else []
        by_rank: dict[int, dict[int, list[Event]]] = {}
        for (rank, stage), worker in sorted(self.pipeline.workers.items()):
            by_rank.setdefault(rank, {})[stage] = worker.timeline
        for rank, timelines in by_rank.items():
            lines += self._explain_rank(rank, timelines)
        return "\n".join(lines)

    def _rescored_note(self) -> list[str]:
        """Where the plan was re-scored for the rows the first step ran: what the comparison's
        other rows are."""
        since = self.plan.options.get("rescored_from")
        if not since:
            return []
        return [
            f"(planned at {since['microbatch_size']} rows per microbatch; the chosen row is "
            f"re-scored for the {self.plan.microbatch_size} the first step ran, the others' "
            "steps scaled as its step was, their memory as planned)"
        ]

    def _explain_replan(self) -> list[str]:
        """With compile(replan=...): the decision, and the measured step before and after."""
        decision = self.replanner.decision if self.replanner else None
        if decision is None:
            return []
        lines = [decision.describe()]
        moved = self.replanner.moved_at
        if moved is not None:
            lines.append(f"  moved after step {moved} in {self.replanner.move_s:.2f} s")
            steps = list(self._measured)
            after = steps[len(steps) - (self.steps - moved) :] if self.steps > moved else []
            before = steps[: len(steps) - len(after)]
            for name, part in (("before", before[1:] or before), ("after", after)):
                if part:
                    median = sorted(s for _, s, _ in part)[len(part) // 2]
                    lines.append(f"  measured {name} the move: median {human_seconds(median)} "
                                 f"per step over {len(part)} steps")  # fmt: skip
        return [*lines, ""]

    def _explain_rank(self, rank: int, timelines: dict[int, list[Event]]) -> list[str]:
        """One rank: its bubble over all its stages (measured and simulated) and its memory,
        then its stages' times (on the same line when it runs one stage)."""
        events = [e for timeline in timelines.values() for e in timeline]
        plan = self.plan
        simulated = rank < len(plan.rank_idle)  # as rank_memory; a plan built by hand lacks both
        predicted = f" (predicted {plan.rank_idle[rank]:.0%})" if simulated else ""
        if torch.cuda.is_available():
            memory = human_bytes(torch.cuda.max_memory_allocated())
        else:
            own = sum(plan.stages[s].memory_bytes for s in timelines)
            memory = f"{human_bytes(plan.rank_memory[rank] if simulated else own)} (predicted)"
        mine = [f"bubble {bubble_fraction(events):.0%}{predicted}", f"peak memory {memory}"]
        measured = self._explain_memory(rank)
        if len(timelines) == 1:
            [(stage, timeline)] = timelines.items()
            parts = self._explain_stage(rank, stage, timeline) + mine
            return [f"rank {rank} (stage {stage}): " + ", ".join(parts), *measured]
        stages = ", ".join(map(str, timelines))
        per_stage = [
            f"  stage {stage}: " + ", ".join(self._explain_stage(rank, stage, timeline))
            for stage, timeline in timelines.items()
        ]
        return [f"rank {rank} (stages {stages}): " + ", ".join(mine), *per_stage, *measured]

    def _explain_memory(self, rank: int) -> list[str]:
        """With measure_memory(True): the rank's measured peak and its parts against the
        plan's simulated peak and parts."""
        probe = self._probes.get(rank)
        if probe is None:
            return []
        comparison = memory_probe.compare(self.plan, {rank: probe.report()})[rank]
        return ["  " + line for line in comparison.describe().splitlines()]

    def _explain_stage(self, rank: int, stage: int, events: list[Event]) -> list[str]:
        """One stage on one rank: measured times per microbatch and per update."""
        seconds: dict[str, float] = {}
        for e in events:
            seconds[e.kind] = seconds.get(e.kind, 0.0) + e.duration
        microbatches = sum(1 for e in events if kind(e.kind).ends)
        updates = sum(1 for e in events if e.kind == STEP)

        def per(kinds: tuple[str, ...], n: int) -> str:
            return human_seconds(sum(seconds.get(k, 0.0) for k in kinds) / n) if n else "-"

        predicted = self.plan.stages[stage]
        parts = [
            f"forward+backward {per(COMPUTE, microbatches)}/microbatch (predicted "
            f"{human_seconds(predicted.forward_s + predicted.backward_s)}/minibatch of "
            f"{self.plan.microbatch_size or 'the profiled'} rows)"
        ]
        uneven = {u.stage: u for u in self.plan.uneven_splits}
        if stage in uneven:  # the plan's note says why and the way out
            split = uneven[stage]
            mine = split.counts[split.ranks.index(rank)]
            parts.append(
                f"runs {mine} of the step's {split.num_microbatches} microbatches (stage "
                f"{stage}'s replicas: {'/'.join(map(str, split.counts))})"
            )
        if SEND in seconds or RECV in seconds:
            parts.append(f"send+receive {per((SEND, RECV), microbatches)}/microbatch")
        if ALLREDUCE in seconds or CLIP in seconds:
            parts.append(f"all-reduce+clip {per((ALLREDUCE, CLIP), updates)}/update")
        return parts

    def save_trace(self, path: str | Path, steps: int | None = None) -> None:
        """Write the actions the ranks recorded as a Chrome trace (`runtime.timeline`), which
        Perfetto opens and `pdcompile simulate --measured` draws beside a simulation; it holds
        the plan that ran, so `pdcompile plan --measured` re-plans from it.

        Every rank calls it. Under torch.distributed the ranks' events are gathered and rank 0
        writes; in one process every rank's events are written. Times are `perf_counter`
        seconds: ranks on one machine share that clock; a machine other than rank 0's is moved
        onto rank 0's clock by the difference of the two clocks as the ranks leave one barrier
        here, which is exact up to that barrier's exit skew (about one network latency).

        Args:
            path: the JSON file to write.
            steps: only the actions that started during the last `steps` train steps (None:
                all recorded; a rank keeps its last 50,000 actions).
        """
        recorded = len(self._measured)
        since = self._measured[-steps][0] if steps and recorded >= steps else float("-inf")
        events = [e for w in self.pipeline.workers.values() for e in w.timeline if e.start >= since]
        if isinstance(self.pipeline, DistributedPipeline):
            from pdcompile.runtime.bounded import collective

            everyone: list[Any] = [None] * dist.get_world_size()

            def gather() -> None:
                dist.barrier()
                mine = (socket.gethostname(), time.perf_counter(), events)
                dist.all_gather_object(everyone, mine)

            collective(self.rank, "gathering the trace", gather, self.pipeline.comm.timeout_s,
                       culprit="did not call save_trace")  # fmt: skip
            host0, mark0, _ = everyone[0]
            offset = {host0: 0.0}
            for host, mark, _ in everyone:
                offset.setdefault(host, mark0 - mark)
            events = [
                e._replace(start=e.start + offset[host], end=e.end + offset[host])
                for host, _, theirs in everyone
                for e in theirs
            ]
            if self.rank != 0:
                return
        to_chrome_trace(events, path, meta={"plan": self.plan.to_dict()})  # for --measured


def _saved_plan(extra: dict[str, Any], directory: str) -> Plan | None:
    """The plan a checkpoint's `extra` records (None: saved before plans were recorded, or
    unreadable: then the job stays on its own plan, with a warning)."""
    data = extra.get("plan")
    if not isinstance(data, torch.Tensor):
        return None
    try:
        return Plan.from_json(data.numpy().tobytes().decode(), source=f"{directory} (its plan)")
    except (PdcompileError, UnicodeDecodeError) as exc:
        log.warning("checkpoint %s records a plan that does not read (%s): resuming on the "
                    "plan compile made", directory, exc)  # fmt: skip
        return None

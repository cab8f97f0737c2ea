"""The conformance suite (benchmarks/conformance.py): each architecture through trace, analyze,
plan, codegen and compile (docs/conformance.md).

By default only `SAMPLE` runs (about 40 s); the others are marked `conformance_full` and
skipped unless `PDCOMPILE_CONFORMANCE=all` is set or `-m conformance_full` is given.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from conformance import STEPS, run_architecture  # noqa: E402
from conformance_models import ARCHITECTURES, SAMPLE  # noqa: E402

# (architecture, step) -> what the PdcompileError's message must say: a refusal that names the
# module or construct it cannot handle. Any other failure, and every bare Python error, fails.
KNOWN_REFUSALS: dict[tuple[str, str], str] = {}


def _full(config: pytest.Config) -> bool:
    marks = (config.option.markexpr or "").strip()
    return os.environ.get("PDCOMPILE_CONFORMANCE") == "all" or marks == "conformance_full"


def _params() -> list:
    full = pytest.mark.conformance_full
    return [pytest.param(n, marks=() if n in SAMPLE else full) for n in ARCHITECTURES]


@pytest.mark.parametrize("name", _params())
def test_architecture_passes_every_phase(name: str, request: pytest.FixtureRequest) -> None:
    if name not in SAMPLE and not _full(request.config):
        pytest.skip("conformance_full: set PDCOMPILE_CONFORMANCE=all or pass -m conformance_full")
    if ARCHITECTURES[name].family != "classic":
        pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only costs, more so on a busy CPU
    try:
        results = run_architecture(ARCHITECTURES[name])
    finally:
        torch.set_num_threads(threads)
    problems = []
    for step in STEPS:
        r = results[step]
        if r.status != "failed":  # ok, or skipped after a failure reported at its prerequisite
            continue
        pattern = KNOWN_REFUSALS.get((name, step))
        if r.pdcompile_error and pattern and re.search(pattern, str(r.exception)):
            continue
        kind = "refusal not listed" if r.pdcompile_error else "bare error"
        problems.append(f"{step} ({kind}, {r.origin or 'outside pdcompile'}): {r.error}")
    assert not problems, f"{name}:\n" + "\n".join(problems)


def test_the_sample_and_the_suite_cover_every_family() -> None:
    assert len(ARCHITECTURES) >= 30 and set(SAMPLE) <= set(ARCHITECTURES)
    families = {a.family for a in ARCHITECTURES.values()}
    assert families == {"decoder", "encoder", "seq2seq", "vision", "classic"}
    assert families - {"seq2seq"} <= {ARCHITECTURES[n].family for n in SAMPLE}

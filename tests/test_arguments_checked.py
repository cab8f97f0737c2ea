"""Arguments are checked at once (issue 31): `compile`'s planning arguments whatever the path
(a given plan too), `memory=` by name, and `pdcompile plan --measured TRACE` on hostile traces:
a named error and exit code 1, never a re-plan on garbage or a raw IndexError/TypeError."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_replan import CLUSTER, costs, synthetic

import pdcompile
from pdcompile import PartitionError
from pdcompile.cli.handlers import main
from pdcompile.passes.planning import recompute_choice
from pdcompile.passes.planning.timeline import to_chrome_trace


@pytest.mark.parametrize(
    "option, words",
    [
        ({"memory": "garbage"}, "cannot read memory 'garbage'"),
        ({"memory": -1}, "memory=-1 is -1.0 bytes"),
        ({"memory": float("nan")}, "memory=nan"),
        ({"allow_async": "yes"}, "allow_async must be True or False"),
        ({"recompute": "yes"}, "recompute must be None"),
        ({"global_batch_size": 2.5}, "global_batch_size must be an integer"),
        ({"global_batch_size": True}, "global_batch_size must be an integer"),
        ({"solver": "nope"}, "unknown solver 'nope'"),
    ],
)
def test_compile_checks_its_planning_arguments_with_a_plan_given(option, words) -> None:
    model, x = nn.Linear(4, 4), torch.randn(8, 4)
    with pytest.raises(PartitionError, match=words):
        pdcompile.compile(model, (x,), loss_fn=F.mse_loss, plan="never-read.json",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **option)  # fmt: skip


def test_memory_auto_on_a_host_reporting_no_memory_says_what_it_found(monkeypatch) -> None:
    monkeypatch.setattr(recompute_choice, "_available_ram", lambda: 0.0)
    with pytest.raises(PartitionError, match=r"memory='auto' found 0 B of available RAM over 2"):
        recompute_choice.limited(pdcompile.Cluster.coerce(2), "auto")


def _x(data: dict) -> list[dict]:
    return [e["args"] for e in data["traceEvents"] if e.get("ph") == "X"]


def _edit(kind: str, key: str, value) -> callable:
    def edit(data: dict) -> None:
        for args in _x(data):
            if args["kind"] in kind:
                args[key] = value(args[key]) if callable(value) else value

    return edit


def _other_model(data: dict) -> None:
    data["otherData"]["plan"]["stages"][0]["nodes"][1] = "another_models_node"


HOSTILE = {
    "negative durations": (_edit("F", "end", lambda v: v - 10), "negative duration"),
    "NaN times": (_edit("F", "start", float("nan")), "no finite number"),
    "string times": (_edit("B", "end", "1.0"), "no finite number"),
    "a negative stage": (_edit("FB", "stage", -1), "stage is negative"),
    "a stage the plan lacks": (_edit("FB", "stage", 7), r"stages \[7\] are not the plan's"),
    "no compute events": (_edit("FB", "kind", "send"), r"no forward and backward of stages"),
    "another model's stages": (_other_model, "not a plan of this cost graph"),
}


def test_plan_measured_refuses_hostile_traces(tmp_path, capsys) -> None:
    true, wrong = costs()
    ran = pdcompile.plan(wrong, CLUSTER, num_microbatches=4)
    trace, graph = tmp_path / "run.json", tmp_path / "costs.json"
    to_chrome_trace(synthetic(ran, true), trace, meta={"plan": ran.to_dict()})
    wrong.save(graph)
    command = ["plan", str(graph), "--cluster", CLUSTER, "--measured"]
    assert main([*command, str(trace)]) == 0
    capsys.readouterr()
    base = json.loads(trace.read_text())
    for name, (edit, words) in HOSTILE.items():
        data = copy.deepcopy(base)
        edit(data)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        assert main([*command, str(bad)]) == 1, name
        err = capsys.readouterr().err
        assert re.search(words, err), f"{name}: {err}"

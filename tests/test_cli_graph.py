"""`pdcompile graph`: every format, --leaf, and one-line errors for bad specs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdcompile import zoo
from pdcompile.cli.handlers import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_txt_table_lists_every_node_with_totals(capsys) -> None:
    code, out, _ = run(capsys, "graph", "pdcompile.zoo:gpt")
    assert code == 0
    assert "h_0_attn_c_attn" in out and "call_module" in out and "[4, 16, 192]" in out
    model = zoo.gpt()[0]
    assert f"{sum(p.numel() for p in model.parameters()):,}" in out  # tied weights counted once
    assert "87 nodes" in out and "(tied)" in out and "captured by fx in train mode" in out


def test_json_is_the_same_content_machine_readable(capsys, tmp_path: Path) -> None:
    target = tmp_path / "g.json"
    code, out, _ = run(
        capsys, "graph", "pdcompile.zoo:hf_gpt2", "--format", "json", "--out", str(target)
    )
    assert code == 0 and out == ""
    doc = json.loads(target.read_text())
    assert doc["capture"] == "export" and doc["model"] == "GPT2LMHeadModel"
    model = zoo.hf_gpt2()[0]
    assert doc["totals"]["param_count"] == sum(p.numel() for p in model.parameters())
    assert len(doc["nodes"]) == doc["totals"]["nodes"]
    tied = [p for p in doc["params"] if len(p["names"]) == 2]
    assert {tuple(sorted(p["names"])) for p in tied} == {
        ("lm_head.weight", "transformer.wte.weight")
    }
    linear = [n for n in doc["nodes"] if n["target"] == "aten.linear.default"][-1]
    assert linear["shapes"] == [[4, 16, 128]] and linear["shared_params"] == [
        "transformer.wte.weight"
    ]


def test_dot_labels_edges_with_shapes(capsys) -> None:
    code, out, _ = run(capsys, "graph", "pdcompile.zoo:mlp", "--format", "dot")
    assert code == 0 and out.startswith('digraph "MLP" {') and out.rstrip().endswith("}")
    assert '"x" -> "net_0" [label="[4, 32]"];' in out


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is installed by .ci/run")
@pytest.mark.parametrize(("fmt", "magic"), [("svg", b"<svg"), ("png", b"\x89PNG")])
def test_svg_and_png_are_drawn_by_graphviz(capsys, tmp_path: Path, fmt: str, magic: bytes) -> None:
    target = tmp_path / f"g.{fmt}"
    code, _, _ = run(capsys, "graph", "pdcompile.zoo:unet", "--format", fmt, "--out", str(target))
    assert code == 0 and magic in target.read_bytes()[:400]


def test_missing_graphviz_is_a_one_line_error(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = run(capsys, "graph", "pdcompile.zoo:mlp", "--format", "svg", "--out", "x.svg")
    assert code == 1 and "install Graphviz" in err and "apt-get install graphviz" in err
    assert err.count("\n") == 1


def test_binary_formats_need_an_output_file(capsys) -> None:
    code, _, err = run(capsys, "graph", "pdcompile.zoo:mlp", "--format", "png")
    assert code == 1 and "--out FILE" in err


def test_leaf_by_class_name_and_by_qualified_name(capsys) -> None:
    code, out, _ = run(
        capsys, "graph", "pdcompile.zoo:gpt", "--format", "json", "--leaf", "Block", "lm_head"
    )
    assert code == 0
    modules = [n["target"] for n in json.loads(out)["nodes"] if n["op"] == "call_module"]
    assert [m for m in modules if m.startswith("h.")] == ["h.0", "h.1", "h.2", "h.3"]
    code, _, err = run(capsys, "graph", "pdcompile.zoo:gpt", "--leaf", "h.7")
    assert code == 1 and "'h.7'" in err and "not a submodule" in err


def test_auto_leaves_are_reported_on_stderr(capsys) -> None:
    code, out, err = run(capsys, "graph", "pdcompile.zoo:data_dependent")
    assert code == 0 and "router" in out
    assert (
        err.startswith("warning: 1 submodule(s) of DataDependent became leaves")
        and "x.mean() > 0" in err
    )


FACTORIES = textwrap.dedent(
    """
    import torch

    def good():
        return torch.nn.Linear(3, 2), (torch.randn(4, 3),)

    def raises():
        raise RuntimeError("no weights here")

    def not_a_tuple():
        return torch.nn.Linear(3, 2)

    def not_a_module():
        return "linear", (torch.randn(4, 3),)

    def bad_kwargs():
        return torch.nn.Linear(3, 2), (torch.randn(4, 3),), [1]

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def test_file_spec_works(capsys, factories: Path) -> None:
    code, out, _ = run(capsys, "graph", f"{factories}:good", "--format", "json")
    assert code == 0 and json.loads(out)["totals"]["param_count"] == 8


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("pdcompile.zoo", "must look like 'package.module:factory'"),
        ("no_such_package.models:build", "no module named 'no_such_package'"),
        ("{dir}/missing.py:good", "no such file"),
        ("pdcompile.zoo:gtp", "has no attribute 'gtp' (functions there: data_dependent, gpt,"),
        ("{file}:NOT_CALLABLE", "is a int, not a factory"),
        ("{file}:raises", "the factory raised RuntimeError('no weights here')"),
        ("{file}:not_a_tuple", "returned a Linear; it must return (model, example_inputs)"),
        ("{file}:not_a_module", "first value is a str, not an nn.Module"),
        ("{file}:bad_kwargs", "example_kwargs is a list, not a dict"),
    ],
)
def test_bad_spec_is_one_line_exit_2_without_traceback(
    capsys, factories: Path, spec: str, words: str
) -> None:
    spec = spec.format(file=factories, dir=factories.parent)
    code, out, err = run(capsys, "graph", spec)
    assert code == 2 and out == ""
    assert words in err and err.startswith("pdcompile: error: model spec")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_debug_shows_the_traceback(factories: Path) -> None:
    from pdcompile import SpecError

    with pytest.raises(SpecError, match="factory raised"):
        main(["--debug", "graph", f"{factories}:raises"])


def test_console_script_runs_outside_the_repository(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("pdcompile")
    assert script.exists(), "the pdcompile console script is not installed"
    done = subprocess.run(
        [str(script), "graph", "pdcompile.zoo:mlp", "--format", "json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "MLP"
    bad = subprocess.run(
        [str(script), "graph", "nowhere:nothing"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_cli_capture_methods_are_the_api_methods() -> None:
    from pdcompile.capture import tracing
    from pdcompile.cli import parser as cli_parser

    assert cli_parser.METHODS == tracing.METHODS


def test_every_command_of_the_parser_has_a_handler() -> None:
    from pdcompile.cli import handlers as cli
    from pdcompile.cli import parser as cli_parser

    parser = cli_parser.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == set(cli.COMMANDS)

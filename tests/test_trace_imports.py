"""A symbolic `pdcompile.trace` leaves torch._dynamo and torch._inductor unimported (issue 32:
fx's stack-trace recording imported both, 1.2 s of an idle cold start and 6-7 s of a loaded
one); the nodes keep the user's source lines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import pdcompile

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x):
            y = self.a(x).relu()  # the user's line
            return self.b(y)

    gm = pdcompile.trace(Small(), (torch.randn(2, 4),))
    print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
    print(any("the user's line" in (n.stack_trace or "") for n in gm.graph.nodes))
    """
)


def test_fx_trace_imports_no_dynamo_or_inductor(tmp_path) -> None:
    script = tmp_path / "small.py"  # a file, so the frames have source lines
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PDCOMPILE_PROGRESS": "off"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    imported, has_line = out.stdout.split("\n")[:2]
    assert imported == "[]", f"a symbolic trace imported {imported}"
    assert has_line == "True"

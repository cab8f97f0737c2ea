"""The models the runtime and simulator benchmarks share: (model, inputs, targets, loss_fn).

The MLP 256-1024x3-10 with a batch of 64, and the GPT-style decoder (4 layers, width 128) with
16 sequences of 32 tokens.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pdcompile import zoo


def mlp_case():
    torch.manual_seed(0)
    model = zoo.MLP(d_in=256, d_hidden=1024, d_out=10, p=0.0).train()
    return model, torch.randn(64, 256), torch.randint(0, 10, (64,)), F.cross_entropy


def gpt_case():
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(n_layer=4, n_embd=128, dropout=0.0)).train()
    x, y = torch.randint(0, 128, (16, 32)), torch.randint(0, 128, (16, 32))
    return model, x, y, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())


CASES = {"mlp": mlp_case, "gpt": gpt_case}

# glibc's malloc keeping freed memory (allocations up to 32 MiB from a heap never trimmed): with
# its defaults, whether a step's gradients land on pages just given back to the system (a page
# fault per 4 KiB) changes from process to process (docs/runtime.md, docs/simulator.md)
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def keep_freed_memory(default_malloc: bool) -> None:
    """Unless `default_malloc`, the ranks' processes (which read it when they start) run with
    `KEEP_FREED_MEMORY`."""
    if not default_malloc:
        os.environ.setdefault("GLIBC_TUNABLES", KEEP_FREED_MEMORY)

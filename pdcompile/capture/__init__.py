"""Capture: an `nn.Module` and its example call to a torch.fx GraphModule (`pdcompile.trace`).

Symbolic tracing with the leaf policy (`fx_capture`, `leaf_policy`), `torch.export` where it
cannot follow (`export_capture`), the example call split into graph inputs and constants
(`inputs`), and model specs of the command line (`model_spec`).
"""

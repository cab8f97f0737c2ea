"""`pdcompile.compile`'s settings and steps: the configs (`plan_config.py`, `train_config.py`,
`settings.py` for compile's keywords), the ranks' agreement (`ranks.py`), and the steps from
capture to the wrapped module (`steps.py`, `build.py`, `weights.py`)."""

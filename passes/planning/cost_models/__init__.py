"""Cost models besides the default (`cost_model.CostModel`, "pdcompile"): one file each, found
by listing this package, so a new model is its file and no other edit. Torch-free."""

"""From a torch.nn.Module to an Executable of ipusim programs: capture (a joint forward-backward ATen
graph with blocks), lowering to IR, lowering to ipusim, weight updates (`executable.compile_model`
runs them in order)."""

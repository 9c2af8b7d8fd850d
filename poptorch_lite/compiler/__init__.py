"""From a torch.nn.Module to an Executable of ipusim programs: capture, IR, autodiff, lowering,
weight updates (`executable.compile_model` runs them in order)."""

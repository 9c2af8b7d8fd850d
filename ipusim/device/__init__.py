"""The device: targets, tensors and tile mappings, vertices and compute sets, programs, tile
memory, the Engine, and static cycle and memory accounting (the Poplar + IPU Model role)."""

"""What PopTorch users call: Options, enums, blocks and execution strategies, batching rules,
the DataLoader, optimisers and PopTorch's extra ops. Imports nothing of the compiler or runtime."""

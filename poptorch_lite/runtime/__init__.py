"""Running compiled models: PoplarExecutor (what trainingModel / inferenceModel return), the
executable cache, profiling and cross-process gradient reduction."""

"""The training loop and its objects: the run's config, the DeepSpeed engine, data, checkpoints, metrics
and the loss-scale and gradient-norm checks; the command-line entry points call into it from zoo.cli."""

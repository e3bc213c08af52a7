"""One training run: the command line, the loop, the run directory it writes, checkpoints, signals,
the engine's identity and lock, and the control path a dashboard uses to steer it."""

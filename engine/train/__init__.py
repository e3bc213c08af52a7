"""Training over a backend: the optimizer step of DESIGN §4 and the Python API of DESIGN §10
(`Trainer`). Above the backends (engine.backends), below the run (engine.run)."""

"""The model: parameter layout, learning-rate schedule and clipping, the optimizer step over a
backend (`Trainer`), and sampling text from it. The backends (engine.backends) run the ops."""

"""The model as data: the parameter layout (DESIGN §2), the learning-rate schedule and clipping,
and sampling text from a backend's logits. Below the backends (engine.backends), which run its
ops; the optimizer step over a backend is engine.train."""

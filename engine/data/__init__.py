"""Data: tokenizer, sources (built-in and local files in their formats), prep (plan, readers,
encoders, encoder processes, resumable shards), token shards, the batch sampler.

Import from the submodules (`engine.data.tokenizer`, `.sources`, `.shards`, `.sampler`, `.prep`,
...); this package file stays empty so importing one part does not load the others.
"""

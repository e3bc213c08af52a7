"""Data: tokenizer, sources (built-in and local files), token shards, the batch sampler, prep.

Import from the submodules (`engine.data.tokenizer`, `.sources`, `.shards`, `.sampler`, `.prep`);
this package file stays empty so importing one part does not load the others.
"""

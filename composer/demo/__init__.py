"""The embedded demo models as package data (`models/`) and their lookup by name (`packaged`).

Only what the engine needs at run time lives here. The code that made the models (synthetic clips, VAE and
DiT training, the prompt-following score) is the repository's top-level `demo/` package, which is not
shipped and which nothing under `composer/` imports.
"""

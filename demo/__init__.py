"""How the embedded shapes models are made and scored: synthetic clips, VAE and DiT training, the score.

Not part of the installed `composer` package (the engine never imports it); run from a source checkout through
`scripts/train_demo_model.py` and `scripts/eval_demo_model.py`. See demo/README.md.
"""

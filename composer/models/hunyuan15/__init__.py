"""HunyuanVideo-1.5: composer's own DiT for diffusers' `HunyuanVideo15Transformer3DModel` checkpoints."""

"""HunyuanVideo: composer's own DiT for diffusers' `HunyuanVideoTransformer3DModel` checkpoints."""

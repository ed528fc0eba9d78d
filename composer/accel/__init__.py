"""Hooks that change how a loaded model runs without changing its code: LoRA adapters (lora.py)."""

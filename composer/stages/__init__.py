"""Pipeline stages: each a small class with forward(batch) -> batch and optional declarative checks."""

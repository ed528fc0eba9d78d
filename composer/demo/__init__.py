"""The embedded default model: synthetic moving-shapes data, training, and a prompt-following score."""

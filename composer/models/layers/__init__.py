"""Building blocks shared by composer's models: norms, rotary embeddings, timestep embeddings."""

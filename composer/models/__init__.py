"""composer's own model code. Each model module declares `EntryClass`; the model registry finds it by AST."""

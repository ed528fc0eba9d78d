"""Pipelines: an ordered list of stages over loaded modules. Each family module declares `EntryClass`."""

"""Converters from other checkpoint formats into model folders composer serves."""

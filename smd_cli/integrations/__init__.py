"""Integrations of the engine into other libraries' trainers (optional extras; nothing in smd_cli imports them)."""

"""Integrations of attnsdk into model libraries (``attnsdk.integrations.transformers``).

Each module imports its library on first use, never at ``import attnsdk``.
"""

"""Choosing a backend: the registry, ``AttentionConfig``, ``create_backend`` / ``explain`` /
"auto", the ``routed`` composite and debug mode. Imports backends and below."""

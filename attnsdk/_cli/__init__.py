"""The ``attnsdk`` command: ``main`` in ``main.py``, one module per subcommand."""

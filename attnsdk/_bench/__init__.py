"""What ``attnsdk bench`` and benchmarks/ run: the cases and floors (``common``), the raw
kernels they are compared with (``raw``) and the runner (``suite``)."""

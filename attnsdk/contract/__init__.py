"""The contract: the records and rules an engine and a backend share.

Errors and reasons, argument checks, ``LayerSpec``, ``KVCacheLayout`` / ``KVCache``,
``AttentionMetadata`` and its validation, ``Capabilities``, ``Plan`` and ``GraphBuffers``, and
the ``Backend`` protocol. Nothing here imports anything above it (features, kernels, backends,
selection, adapters): tests/core/test_layers.py pins the direction.
"""

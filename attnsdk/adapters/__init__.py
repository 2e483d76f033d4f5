"""Engine adapters, installed as ``attnsdk.adapters``: one subpackage per engine.

Adapters never import their engine at run time; they read its batch objects by attribute name.
"""

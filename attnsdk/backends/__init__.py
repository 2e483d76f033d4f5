"""The backends: ``base`` (``BackendBase``, the author kit) and ``gpu`` (``DeviceStoreBackend``),
``reference`` (the oracle), one package per GPU backend (``fa3``, ``flashinfer``, ``flex``), and
``graphs`` (``GraphRunner``). Importing a backend module never imports its kernel library."""

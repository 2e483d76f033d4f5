"""One module per optional semantics (chunked local attention, tree verify, cross-attention,
ragged attention, the log-sum-exp): who refuses what, and how a step of it becomes steps the
kernels run. Imports only the contract."""

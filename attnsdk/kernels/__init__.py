"""Device code the backends share: the Triton KV store and its device flag, the Triton merge of
attention states, and kernel-package probes. Imports the contract and features only."""

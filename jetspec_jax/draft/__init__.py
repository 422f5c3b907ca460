"""Drafters: the block draft head (causal = JetSpec, bidirectional = DFlash) and its
path-conditioned second pass."""

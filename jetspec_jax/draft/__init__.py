"""Drafters behind one interface (`drafter.py`): the block draft head (causal = JetSpec,
bidirectional = DFlash) with its path-conditioned second pass, and the EAGLE-style head."""

"""Drafters behind one interface (`drafter.py`): the block draft head (causal = JetSpec,
bidirectional = DFlash); other heads plug in by registering their config type."""

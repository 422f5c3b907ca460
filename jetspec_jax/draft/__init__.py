"""Drafters behind one interface (`drafter.py`): the block draft head (causal = JetSpec,
bidirectional = DFlash) and the draft tree it grows (`tree.py`); other heads plug in by
registering their config type."""

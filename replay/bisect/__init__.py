"""Bisecting nondeterminism: steps, co-batched requests (ddmin), layers (hooks), configuration knobs (ddmin)."""

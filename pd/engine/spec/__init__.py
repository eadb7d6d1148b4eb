"""Speculative decoding: draft tokens proposed by lookup, verified in one forward pass (``speculator``)."""

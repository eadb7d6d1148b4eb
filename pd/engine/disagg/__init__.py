"""Disaggregated serving inside the engine: the prefill side's leases and the decode side's pulls.

``connector`` is what the engine calls; ``lease`` pins a prompt's blocks for a decode replica;
``pulls`` reads KV across tensor-parallel splits.
"""

"""The KV tiers behind the device pool: host memory (``host``), the local disk and the shared store (``store``).

``tiers`` is the one object the engine holds (``KVTiers``, or ``NoTiers`` without a host tier);
``loads`` holds requests while their blocks are read from below; ``io`` is the seam between a tier's
decisions and its bytes (``block_store``: records over NIXL; the simulator gives modelled ones).
"""

"""The NIXL build this process loads: import ``nixl_agent`` and ``nixl_agent_config`` from here.

NIXL ships one wheel per CUDA major (``nixl_cu12``, ``nixl_cu13``) behind the
``nixl`` package, which picks the one matching the CUDA the process has, and
``nixl_cu13`` when it has none. Two builds never load in one process (their
bindings register the same types), so every NIXL user here imports this module.

On a machine without CUDA we load ``nixl_cu12``: its UCX, POSIX and OBJ
plugins link no CUDA library, while ``nixl_cu13``'s OBJ plugin (the shared KV
store, ``pd.engine.block_store``) links CUDA 13's GPUDirect Storage object
client and does not load there. With CUDA, ``nixl``'s own choice stands.
"""

from __future__ import annotations

import importlib

import torch

try:
    if torch.version.cuda is None:
        _api = importlib.import_module("nixl_cu12._api")
    else:
        _api = importlib.import_module("nixl._api")
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("NIXL is not installed: pip install nixl") from exc

nixl_agent = _api.nixl_agent
nixl_agent_config = _api.nixl_agent_config
BUILD = _api.__name__.split(".")[0]

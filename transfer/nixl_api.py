"""The NIXL build this process loads: import ``nixl_agent`` and ``nixl_agent_config`` from here, and make
agents over UCX with ``make_agent`` (``nixl_agent``'s own spin a core each).

NIXL ships one wheel per CUDA major (``nixl_cu12``, ``nixl_cu13``) behind the
``nixl`` package, which picks the one matching the CUDA the process has, and
``nixl_cu13`` when it has none. Two builds never load in one process (their
bindings register the same types), so every NIXL user here imports this module.

On a machine without CUDA we load ``nixl_cu12``: its UCX, POSIX and OBJ
plugins link no CUDA library, while ``nixl_cu13``'s OBJ plugin (the shared KV
store, ``pd.engine.tiers.block_store``) links CUDA 13's GPUDirect Storage object
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

# How long NIXL's UCX progress thread sleeps in poll() when no event wakes it sooner.
PROGRESS_DELAY_US = 10_000


def make_agent(name: str, backends: list[str]) -> nixl_agent:
    """A NIXL agent with ``backends``, whose UCX progress thread sleeps between events.

    ``nixl_agent`` sets the progress thread's delay to 0 µs, and the UCX plugin
    waits for events with ``poll()`` for that delay in whole milliseconds: 0, a
    poll that returns at once. Each agent's thread then spins a core, idle or
    not, and on a machine whose engines compute on the same cores it takes a
    core from them. So the agent is made again with a delay before its backends
    are: the thread sleeps until UCX signals work (its worker is armed for
    wake-ups), or at the latest after the delay. The thread itself stays: an
    agent whose blocks a peer reads must make progress without being polled.
    """
    agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=[]))
    bindings = _api.nixlBind  # the bindings of the build this process loaded
    if not isinstance(getattr(agent, "agent", None), bindings.nixlAgent):
        raise RuntimeError(f"{BUILD}'s nixl_agent no longer keeps its bound agent in .agent: make_agent cannot "
                           "give it a progress thread that sleeps")
    config = bindings.nixlAgentConfig(True, False)  # a progress thread, no listener
    config.pthrDelay = PROGRESS_DELAY_US
    config.syncMode = bindings.NIXL_THREAD_SYNC_NONE  # as nixl_agent chooses without a listener
    config.captureTelemetry = True  # a finished read reports the bytes it moved (NixlTransport counts them)
    agent.agent = bindings.nixlAgent(name, config)
    agent.plugin_list = agent.agent.getAvailPlugins()
    for backend in backends:
        agent.create_backend(backend)
    return agent

"""A discrete-event simulator of the serving system that runs the project's real deciding code.

What decides runs unmodified: real ``LLMEngine``s (their ``Scheduler``,
``KVCacheManager``, ``BlockPool`` and ``KVConnector``), the ingress's
remote-prefill rule and both pools' routing policies (``sim.cluster``).
What is modelled: the forward pass (``sim.cost``, fitted to the real engine
by ``sim.profile`` or from a datasheet by ``sim.hardware``; a replica over
several GPUs by ``sim.expert_parallel``), KV transfers
(``sim.transport``), Ray (``sim.clock``, a call's overhead), LoRA adapters'
weights (``sim.adapters``: the engine's own adapter code runs, a load costs
its bytes) and, on a small host, the cores shared with the rest of the
serving path (``sim.host``).
It runs in one process, without Ray. Where a prompt is computed is a seam
(``sim.placement``): ``bench.router`` compares routers through it, and
``bench.router_lora`` adapter-aware routing on a multi-LoRA trace
(``sim.lora_trace``).

The ingress's flow control can stand before a deployment (``sim.flow_gate``:
the app's own ``FlowController``, fed the routers' predictions and the
replicas' reports).

Commands: ``sim.profile``, ``sim.validate`` (against the real app),
``sim.scale``, ``sim.plan`` (pool sizing), ``sim.run`` (one replica),
``sim.flow`` (overload through flow control: tenants, bands, deadlines).
"""

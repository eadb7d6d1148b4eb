"""A discrete-event simulator of the serving system that runs the project's real deciding code.

What decides runs unmodified: a real ``LLMEngine``, with its ``Scheduler``,
``KVCacheManager`` and ``BlockPool`` (chunked prefill, prefix caching,
preemption). What is modelled: the forward pass (``sim.engine``'s runner,
timed by ``sim.cost``, fitted to the real engine by ``python -m sim.profile``)
and time itself (``sim.clock``). It runs in one
process, without Ray and without a model.

So far: one engine replica driven by a trace (``python -m sim.run``). Pools,
routers and KV transfers are the next layers.
"""

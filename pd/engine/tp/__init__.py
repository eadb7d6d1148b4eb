"""Tensor parallelism: the driver (rank 0, in the engine's process) and its workers (ranks 1..N-1).

``driver`` starts the workers and sends them each step; ``worker`` is one worker process
(``python -m pd.engine.tp.worker``); ``group`` is a rank's collective group.
"""

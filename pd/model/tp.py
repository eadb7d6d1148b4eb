"""What one tensor-parallel rank holds of a model (Megatron-style sharding).

With ``size`` ranks, rank ``r`` holds:

- the query heads ``[r * H/size, (r+1) * H/size)`` of every layer's QKV
  projection (column-parallel) and the matching input columns of ``o_proj``
  (row-parallel: each rank's output is a partial sum, all-reduced);
- its KV heads: ``kv/size`` of them when ``size`` divides ``kv``, else the one
  KV head its query heads read (``size`` a multiple of ``kv``: replicated);
- a slice ``[r * I/size, (r+1) * I/size)`` of the MLP's intermediate features
  (gate/up column-parallel, down row-parallel); in an MoE layer, the same
  slice of every expert's intermediate features (and of the shared
  expert's), so each rank's experts give a partial sum, all-reduced once
  with the shared expert's; the router is replicated;
- a slice of the vocabulary, ``ceil(V/size)`` rows (the last rank's shorter),
  for the embedding (looked up where a token falls in it, zeros elsewhere,
  all-reduced) and the LM head (each rank's logits gathered to rank 0).

Norm weights are replicated. Block ids are the same on every rank, so one
block table serves all; each rank's KV pool holds its own heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pd.model.config import ModelConfig


def check_tp(config: ModelConfig, size: int, experts: bool = True) -> None:
    """Raise ``ValueError`` naming the shape that ``size`` ranks cannot split (the experts' too, unless
    ``experts`` is False: under expert parallelism each rank holds its experts whole)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other "
                         "(KV heads are split across ranks, or each replicated over a group of ranks)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")
    moe = config.moe if experts else None
    if moe is not None and moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's expert intermediate size "
                         f"{moe.intermediate_size}")
    if moe is not None and moe.shared_expert_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's shared expert intermediate size "
                         f"{moe.shared_expert_intermediate_size}")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``; ranges are ``(start, stop)`` over the full model's axes."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be within [0, {self.size}), got {self.rank}")

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        per = config.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        kv = config.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * kv // self.size  # the KV head this rank's query heads read
        return head, head + 1

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def expert_intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.moe.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def shared_expert_intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.moe.shared_expert_intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        per = -(-config.vocab_size // self.size)
        return min(self.rank * per, config.vocab_size), min((self.rank + 1) * per, config.vocab_size)

    def vocab_rows(self, config: ModelConfig) -> int:
        """Rows every rank's vocabulary slice is padded to (equal, for the logits gather)."""
        return -(-config.vocab_size // self.size)

    def local_config(self, config: ModelConfig, experts: bool = True) -> ModelConfig:
        """The model as this rank runs it: its heads and MLP slices (the vocabulary stays whole); its experts'
        slices too, unless ``experts`` is False (expert parallelism: each expert whole)."""
        check_tp(config, self.size, experts)
        kv_start, kv_stop = self.kv_heads(config)
        moe = config.moe
        if moe is not None and experts:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size,
                                      shared_expert_intermediate_size=moe.shared_expert_intermediate_size // self.size)
        return dataclasses.replace(
            config, num_heads=config.num_heads // self.size, num_kv_heads=kv_stop - kv_start,
            intermediate_size=config.intermediate_size // self.size, moe=moe)


SINGLE = TPShard(0, 1)


def kv_head_sources(config: ModelConfig, source_size: int, dest: TPShard) -> list[tuple[int, int, int, int]]:
    """Where rank ``dest`` of one split finds its KV heads in the ranks of a ``source_size``-way split.

    ``(source rank, first head there, first head here, count)`` runs, in head
    order, covering ``dest``'s heads once: a decode rank pulls exactly the
    heads it owns, from the prefill ranks that hold them. A head replicated
    over several source ranks (``num_kv_heads < source_size``) is read from one
    of them, chosen by ``dest.rank`` so that destination ranks spread their
    reads. Either split must be valid for the model (``check_tp``).
    """
    check_tp(config, source_size, experts=False)
    check_tp(config, dest.size, experts=False)
    kv = config.num_kv_heads
    start, stop = dest.kv_heads(config)
    runs, head = [], start
    while head < stop:
        if kv >= source_size:
            rank = head // (kv // source_size)
        else:  # replicated: ranks [head * p / kv, (head + 1) * p / kv) each hold this one head
            copies = source_size // kv
            rank = head * copies + dest.rank % copies
        source_start, source_stop = TPShard(rank, source_size).kv_heads(config)
        count = min(stop, source_stop) - head
        runs.append((rank, head - source_start, head - start, count))
        head += count
    return runs

"""The torch.distributed KV transport: pairwise gloo (CPU) or NCCL (CUDA) groups.

``messages`` (wire messages), ``group`` (pairwise groups), ``reader`` (decode
side), ``sender`` (prefill side), ``transport`` (``TorchTransport``).
"""

from transfer.torch.group import new_pair_group
from transfer.torch.messages import Role, TorchPeer
from transfer.torch.transport import TorchTransport

__all__ = ["Role", "TorchPeer", "TorchTransport", "new_pair_group"]

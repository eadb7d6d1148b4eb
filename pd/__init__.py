"""Disaggregated prefill/decode LLM serving on Ray: the engine and its serving layer.

``LLM``, ``CompletionOutput``, ``LoRARequest`` and ``SamplingParams`` are imported on first
use, so that importing a light part of the package (``pd.workload``,
``pd.config``) does not load torch: Serve's controller imports the autoscaling
policy (``autoscale.serve``), which reads ``pd.workload``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pd.llm import LLM, CompletionOutput
    from pd.lora import LoRARequest
    from pd.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "SamplingParams"]
_HOMES = {"LLM": "pd.llm", "CompletionOutput": "pd.llm", "LoRARequest": "pd.lora", "SamplingParams": "pd.sampling_params"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'pd' has no attribute {name!r}")

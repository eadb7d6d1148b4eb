"""Disaggregated prefill/decode LLM serving on Ray: the engine and its serving layer."""

from pd.llm import LLM, CompletionOutput
from pd.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]

"""Ray Serve deployments: PrefillServer, DecodeServer, the OpenAI-compatible Ingress, the app builder.

``pd.serve.GenerateRequest`` and ``pd.serve.GenerateChunk`` are the handle API's types.
"""

from pd.serve.handle_api import GenerateChunk, GenerateRequest

__all__ = ["GenerateChunk", "GenerateRequest"]

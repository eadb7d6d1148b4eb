"""vLLM's CPU engine as a same-run peer, driven over stdin/stdout by ``bench.engine``.

Runs under the peer venv (``make peer-venv``), so it imports nothing of this
project. Started once per checkpoint; then each line on stdin is a JSON
command and each answer one JSON line on the original stdout (everything the
libraries print goes to stderr):

    {"cmd": "run", "prompts": [[ids...], ...], "max_tokens": [n, ...]}
        -> {"elapsed_s": t, "token_ids": [[ids...], ...]}
    {"cmd": "quit"}

Configuration, said once here so the figures can be reproduced: fp32, greedy,
``ignore_eos``, no tokenizer (token-id prompts), prefix caching on (as ours),
``VLLM_CPU_OMP_THREADS_BIND`` set by the driver to the cores it may use, the
engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and
``VLLM_CPU_KVCACHE_SPACE`` of 1 GiB, the KV budget ours gets.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    # Results go on the real stdout; anything the libraries print, to stderr.
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    model_dir = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=True,
              max_model_len=4096, seed=0)
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False)
                  for m in command["max_tokens"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        results.write(json.dumps({"elapsed_s": elapsed, "token_ids": token_ids}) + "\n")


if __name__ == "__main__":
    main()

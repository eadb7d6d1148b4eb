"""How long ``make serve`` takes to answer: ``python -m bench.startup [--config serve_configs/default.yaml]``.

Runs ``serve run CONFIG`` as a user does (its own local Ray, in a process group of its own), and from the
moment it is launched times: ``models_s``, until ``/v1/models`` answers (the ingress is up; the pools may
still be starting); ``first_answer_s``, until the first chat completion, sent then, has answered; and
``first_request_s``, that request's own time. With
``--sdk``, the official ``openai`` client then asks for a streamed chat, a ``json_schema`` response and
``logprobs``, and the line carries what came back. Then it interrupts ``serve run``, which shuts Serve and
its Ray down, and prints one JSON line with the answer's text. ``--repeats N`` starts it N times (the
first start of a fresh cache converts the GGUF model once).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

from bench.engine import isa_info
from pd.workload.host import cpu_name

ROOT = Path(__file__).resolve().parent.parent


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}


def sdk_checks(url: str, model: str) -> dict:
    """A streamed chat, a ``json_schema`` answer and ``logprobs``, through the official ``openai`` client."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=model, messages=question, max_tokens=32, temperature=0, stream=True) if chunk.choices]
    structured = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name the capital of France and its country as JSON."}],
        max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    scored = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2)
    return {
        "stream_chunks": len(chunks), "stream_text": "".join(chunks),
        "json_schema": json.loads(structured.choices[0].message.content),
        "logprobs": [(entry.token, round(entry.logprob, 4), [alt.token for alt in entry.top_logprobs])
                     for entry in scored.choices[0].logprobs.content],
    }


def one_start(config: Path, url: str, timeout_s: float, sdk: bool = False) -> dict:
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    model = args.get("model_name") or args["engine"]["model"]
    started = time.monotonic()
    server = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    def watch() -> None:  # serve run's log, drained so that it never blocks on a full pipe
        for _ in server.stdout:
            pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = {"model": model}
    try:
        deadline = started + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"serve run exited with code {server.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"/v1/models did not answer within {timeout_s} s")
            try:
                if requests.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)  # polling a port that is not open yet: there is nothing to wait on
        result["models_s"] = round(time.monotonic() - started, 1)
        sent = time.monotonic()
        answer = requests.post(f"{url}/v1/chat/completions", timeout=timeout_s, json={
            "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0})
        answer.raise_for_status()
        now = time.monotonic()
        result.update(first_answer_s=round(now - started, 1), first_request_s=round(now - sent, 2),
                      text=answer.json()["choices"][0]["message"]["content"])
        if sdk:
            result["sdk"] = sdk_checks(url, model)
    finally:
        os.killpg(server.pid, signal.SIGINT)  # serve run's Ctrl-C: Serve and its Ray shut down
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        watcher.join(timeout=5)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_configs/default.yaml")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--sdk", action="store_true", help="then check streaming, json_schema and logprobs")
    args = parser.parse_args()
    host = {"cpu": cpu_name(), "cores": os.cpu_count(), **isa_info()}
    for repeat in range(args.repeats):
        row = one_start(ROOT / args.config, args.url, args.timeout, args.sdk)
        print(json.dumps({"case": "startup", "config": args.config, "repeat": repeat, **row, **host}), flush=True)


if __name__ == "__main__":
    main()

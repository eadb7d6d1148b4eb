"""One two-node Ray cluster for the whole session, and helpers to run apps on it.

The head node carries a ``prefill_pool`` resource and the second node a
``decode_pool`` resource, so layouts that pin pools to node groups are real.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from bench.otlp_collector import OtlpCollector
from pd.serve.local import pool_stats, replica_ids  # noqa: F401 - the tests' helpers, from here

CONFIG_DIR = Path(__file__).resolve().parents[2] / "serve_configs"

# Test apps: the tiny built-in model (the configs serve a trained one), short leases, small KV pools,
# less CPU each.
TEST_OVERRIDES = {"kv_lease_s": 3.0}
ENGINE_OVERRIDES = {"model": "builtin:tiny-llama", "kv_cache_bytes": 64 * 1024**2}
TEST_KEYS_ENV = "PD_TEST_API_KEYS"
COLLECTOR: OtlpCollector | None = None  # the session's OTLP receiver, while the cluster runs


def config_args(name: str) -> dict:
    """The ``args`` of the single application in ``serve_configs/<name>``."""
    return yaml.safe_load((CONFIG_DIR / name).read_text())["applications"][0]["args"]


def test_args(name: str, **overrides) -> dict:
    args = config_args(name)
    args.update(TEST_OVERRIDES)
    if COLLECTOR is not None:  # every test app traces its requests to the session's collector
        args["otlp_traces_endpoint"] = COLLECTOR.url
    args["engine"] = {**args.get("engine", {}), **ENGINE_OVERRIDES}
    args.update(overrides)
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    os.environ.setdefault("PD_CACHE_DIR", str(tmp_path_factory.mktemp("pd-cache")))
    # An API key in the nodes' own environment, as an operator would export it before ``ray start``;
    # only apps configured with ``api_keys_env: PD_TEST_API_KEYS`` read it.
    os.environ[TEST_KEYS_ENV] = f"envkey-{uuid.uuid4().hex}"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"prefill_pool": 4}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"decode_pool": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PD_CACHE_DIR": os.environ["PD_CACHE_DIR"]}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    global COLLECTOR
    COLLECTOR = OtlpCollector()
    try:
        yield {"cluster": cluster, "url": f"http://127.0.0.1:{port}", "collector": COLLECTOR}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        COLLECTOR.close()
        COLLECTOR = None


class Client:
    """Plain HTTP against the app, as a user's client would do it."""

    def __init__(self, url: str):
        self.url = url

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, body: dict, **kwargs):
        status, text = self.request("POST", path, body, **kwargs)
        return status, (json.loads(text) if not body.get("stream") else text)

    def stream_events(self, path: str, body: dict) -> list:
        status, text = self.request("POST", path, {**body, "stream": True})
        assert status == 200, text
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        return [json.loads(e) for e in events[:-1]]


_deployed: dict[str, str] = {}


def ensure_app(config: str, **overrides) -> None:
    """Make the ``pd`` app the one from ``serve_configs/<config>`` (with test overrides).

    Tests share one running app; switching configs redeploys it.
    """
    key = f"{config}:{sorted(overrides.items())}"
    if _deployed.get("pd") == key:
        return
    run_app(test_args(config, **overrides))
    _deployed["pd"] = key


def fresh_app(config: str, **overrides) -> None:
    """As ``ensure_app``, but always a new deployment: the running app is deleted first."""
    from ray import serve

    serve.delete("pd")
    _deployed.pop("pd", None)
    ensure_app(config, **overrides)


@pytest.fixture
def default_app(ray_cluster) -> "Client":
    """A client of the default app (``serve_configs/default.yaml``, leases of 3 s)."""
    ensure_app("default.yaml")
    return Client(ray_cluster["url"])


@pytest.fixture(scope="session")
def offline():
    """``offline(token_ids, max_tokens)``: the colocated greedy tokens of ``pd.LLM`` in this process."""
    from pd import LLM, SamplingParams

    llm = LLM("builtin:tiny-llama", num_blocks=256)

    def run(prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        [out] = llm.generate([prompt_token_ids], SamplingParams(max_tokens=max_tokens, temperature=0))
        return out.token_ids

    run.tokenizer = llm.tokenizer
    return run


def run_app(args: dict, name: str = "pd"):
    """Deploy the app on the shared cluster's Serve and wait until it runs (the cluster fixture tears it down)."""
    from pd.serve.local import LocalServe, deploy_args

    deploy_args(LocalServe(), args, name=name, timeout_s=180)


def token_counts(usage: dict) -> dict:
    """A usage object's token counts (its ``prompt_tokens_details`` depend on what earlier tests cached)."""
    return {key: usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; the value, or a TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)

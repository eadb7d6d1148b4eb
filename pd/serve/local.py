"""Start Ray and Serve in this process, deploy an app, and take down what was started: the one helper for it.

    with local_serve(http_port=8000, num_cpus=4) as local:
        local.deploy(build_app(args), ready_url="http://127.0.0.1:8000")
        ...                                    # send requests
    # Serve and the private Ray are shut down, also on an exception or Ctrl-C

Used by the load-test sweep, the benchmarks that serve an app, and the serve
tests; ``replica_ids`` and ``pool_stats`` find and ask a deployment's replicas. ``address="local"`` (the default) starts a private Ray for this process
with ``num_cpus`` and ``env``; on the way out Serve and Ray are shut down.
Another address joins that cluster; on the way out only the apps deployed
through the helper are deleted and the cluster keeps running.

``env`` is set in ``os.environ`` before Ray starts, so the processes Ray starts
inherit it (Serve reads settings such as ``RAY_SERVE_ENABLE_DIRECT_INGRESS``
there), and removed after Ray is down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, Mapping

# Application states after which waiting longer will not help.
FAILED_STATES = ("DEPLOY_FAILED", "UNHEALTHY")
POLL_S = 0.25


class LocalServe:
    """The Serve instance ``local_serve`` started or joined; the apps deployed through it."""

    def __init__(self) -> None:
        self.deployed: list[str] = []

    def deploy(self, app: Any, name: str = "pd", route_prefix: str = "/", ready_url: str | None = None,
               timeout_s: float = 300.0) -> None:
        """Deploy ``app`` (a bound Serve application, e.g. ``build_app(args)``) and wait until it runs.

        Waits for the application to be ``RUNNING`` and, with ``ready_url``
        (the server's base URL), for ``GET ready_url/health`` to answer, so
        the HTTP proxy routes to it (``/health`` needs no API key). Raises ``RuntimeError`` if the app fails
        to deploy, ``TimeoutError`` after ``timeout_s``.
        """
        from ray import serve

        serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
        self.deployed.append(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = serve.status().applications.get(name)
            if status is not None and status.status in FAILED_STATES:
                raise RuntimeError(f"app {name} failed: {status.message}")
            if status is not None and status.status == "RUNNING" and (ready_url is None or _answers(ready_url)):
                return
            time.sleep(POLL_S)  # Serve has no call that waits for an app's state: poll it
        raise TimeoutError(f"app {name} was not up after {timeout_s:.0f} s")

    def delete(self, name: str = "pd") -> None:
        """Delete an app deployed through this helper (it is then not deleted again on the way out)."""
        from ray import serve

        serve.delete(name)
        if name in self.deployed:
            self.deployed.remove(name)


def deploy_args(local: LocalServe, args: Mapping[str, Any], name: str = "pd", ready_url: str | None = None,
                timeout_s: float = 300.0) -> None:
    """Deploy this project's app (``pd.serve.app:build_app``) with ``args``, a ``serve_configs`` app's args."""
    from pd.serve.app import build_app

    local.deploy(build_app(dict(args)), name=name, ready_url=ready_url, timeout_s=timeout_s)


@contextlib.contextmanager
def local_serve(http_port: int | None = None, num_cpus: int | None = None, env: Mapping[str, str] | None = None,
                address: str = "local") -> Iterator[LocalServe]:
    """Ray (a private one for ``address="local"``) with Serve on ``127.0.0.1:http_port``; torn down on exit.

    ``http_port`` None leaves Serve to start on the first deploy, on its own
    default port. ``num_cpus`` applies to a private Ray only.
    """
    import ray
    from ray import serve

    private = address == "local"
    os.environ.update(env or {})
    local = LocalServe()
    try:
        ray.init(address=address, num_cpus=num_cpus if private else None, include_dashboard=False,
                 log_to_driver=False)
        if http_port is not None:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield local
    finally:
        try:
            with _sigint_ignored():  # a second Ctrl-C must not skip the cleanup
                if private:
                    serve.shutdown()
                else:
                    for name in local.deployed:
                        serve.delete(name)
                ray.shutdown()
        finally:
            for name in env or {}:
                os.environ.pop(name, None)


def replica_ids(app: str, deployment: str) -> list[str]:
    """Ids of the live replicas of ``app``'s ``deployment``, from their named actors."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]


def pool_stats(deployment: str, app: str = "pd") -> list[dict]:
    """``stats`` of every replica of an engine pool (``PrefillServer``, ``DecodeServer``), each reached by its id."""
    from ray import serve

    from router.protocol import RouteHints

    handle = serve.get_deployment_handle(deployment, app)
    return [handle.stats_of.remote(RouteHints(request_id="", target_replica_id=rid).encode()).result()
            for rid in replica_ids(app, deployment)]


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored inside; only the main thread may set a handler, so elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _answers(base_url: str) -> bool:
    """Whether ``GET base_url/health`` answers with JSON (the proxy routes to the app)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=10) as response:
            json.loads(response.read())
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False

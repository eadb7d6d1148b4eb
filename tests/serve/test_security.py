"""The sockets the default app opens: none of ours listens beyond loopback."""

from __future__ import annotations

import ipaddress

import psutil

OUR_DEPLOYMENTS = ("Ingress", "PrefillServer", "DecodeServer")


def _listening(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _beyond_loopback(pid: int) -> list[str]:
    return [ip for ip in _listening(pid) if not ipaddress.ip_address(ip.split("%")[0]).is_loopback]


def _our_pids() -> dict[str, list[int]]:
    from ray import serve

    from tests.serve.conftest import pool_stats

    ingress = serve.get_app_handle("pd").process_stats.remote().result()["pid"]
    return {"Ingress": [ingress], **{name: [s["pid"] for s in pool_stats(name)] for name in OUR_DEPLOYMENTS[1:]}}


def test_no_socket_of_ours_listens_beyond_loopback(default_app):
    """A replica of ours may listen beyond loopback only where any Serve replica does (Ray's own sockets)."""
    import os

    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    def probe() -> int:
        return os.getpid()

    baseline_pid = serve.run(probe.bind(), name="socket-probe", route_prefix="/socket-probe").remote().result()
    try:
        rays_own = len(_beyond_loopback(baseline_pid))
        for deployment, pids in _our_pids().items():
            for pid in pids:
                assert len(_beyond_loopback(pid)) == rays_own, (deployment, _listening(pid), rays_own)
    finally:
        serve.delete("socket-probe")

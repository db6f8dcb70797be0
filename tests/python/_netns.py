"""A second simulated host for tests: a network namespace joined to this one by a veth pair
with its own /24 (no common loopback; engines in it have another host id, so they reach
processes here over tcp, never shared memory). Needs root and iproute2: netns_pair() skips the
test otherwise, and removes the namespace and the link afterwards."""
import contextlib
import os
import shutil
import subprocess

import pytest


def _sh(*cmd, ns=None):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    subprocess.run(full, check=True, capture_output=True)


def _veth(ns, veth_host, veth_ns, host_ip, ns_ip):
    """A veth pair, one end here (host_ip/24), the other in namespace ns (ns_ip/24), both up."""
    _sh("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
    _sh("ip", "link", "set", veth_ns, "netns", ns)
    _sh("ip", "addr", "add", f"{host_ip}/24", "dev", veth_host)
    _sh("ip", "link", "set", veth_host, "up")
    _sh("ip", "addr", "add", f"{ns_ip}/24", "dev", veth_ns, ns=ns)
    _sh("ip", "link", "set", veth_ns, "up", ns=ns)


@contextlib.contextmanager
def netns_pair(tag):
    """Yields (namespace, address here, address in the namespace)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    pid = os.getpid()
    ns = f"mc{tag}{pid % 100000}"
    veth_host, veth_ns = f"{ns}h", f"{ns}n"
    net = f"10.{pid % 200 + 20}.{(pid // 200 + sum(map(ord, tag))) % 250}"
    host_ip, ns_ip = f"{net}.1", f"{net}.2"
    try:
        _sh("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"ip netns unavailable: {e.stderr}")
    try:
        _veth(ns, veth_host, veth_ns, host_ip, ns_ip)
        _sh("ip", "link", "set", "lo", "up", ns=ns)
        yield ns, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", veth_host], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def extra_link(ns, tag):
    """A second veth pair between here and namespace `ns` (from netns_pair), with its own /24:
    yields (address here, address in the namespace, cut) where cut() takes this link down and
    aborts every tcp connection over it on both sides (ss -K), as a failed NIC would, while the
    first link stays up. Removed afterwards."""
    pid = os.getpid()
    veth_host, veth_ns = f"{ns}{tag}h", f"{ns}{tag}n"
    net = f"10.{pid % 200 + 20}.{(pid // 200 + sum(map(ord, tag)) + 97) % 250}"
    host_ip, ns_ip = f"{net}.1", f"{net}.2"

    def cut():
        _sh("ip", "link", "set", veth_host, "down")
        subprocess.run(["ss", "-K", "dst", ns_ip], capture_output=True)
        subprocess.run(["ip", "netns", "exec", ns, "ss", "-K", "dst", host_ip],
                       capture_output=True)

    try:
        _veth(ns, veth_host, veth_ns, host_ip, ns_ip)
        yield host_ip, ns_ip, cut
    finally:
        subprocess.run(["ip", "link", "del", veth_host], capture_output=True)

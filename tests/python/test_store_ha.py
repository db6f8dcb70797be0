"""mooncake.store with masters elected through etcd (a real etcd-server started here): setup with
an etcd:// address, the leader killed, the same client reading its objects back from the new
leader and putting again; bad input. The heavy multi-process failover runs are the C++
store_ha_* tests."""
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import free_port, master_bin, stop_process  # noqa: E402

store_mod = pytest.importorskip("mooncake.store")
E = store_mod.ErrorCode

pytestmark = [
    pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built"),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed"),
]


class Etcd:
    """etcd-server on free ports; tls: serve https with a certificate made here (self.ca)."""

    def __init__(self, tls=False):
        self.dir = tempfile.mkdtemp(prefix="mc_pyetcd_")
        cport, pport = free_port(), free_port()
        scheme = "https" if tls else "http"
        c, p = f"{scheme}://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        extra = []
        ctx = None
        if tls:
            self.ca = self._make_certs()
            extra = ["--cert-file", os.path.join(self.dir, "server.crt"),
                     "--key-file", os.path.join(self.dir, "server.key")]
            ctx = ssl.create_default_context(cafile=self.ca)
        self.proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", os.path.join(self.dir, "d"),
             "--listen-client-urls", c, "--advertise-client-urls", c, "--listen-peer-urls", p,
             "--initial-advertise-peer-urls", p, "--initial-cluster", f"t={p}",
             "--log-level", "error", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"127.0.0.1:{cport}"
        self.url = c
        for _ in range(200):
            try:
                req = urllib.request.Request(c + "/v3/kv/range", data=b'{"key": "eA=="}')
                urllib.request.urlopen(req, timeout=1, context=ctx).read()
                return
            except Exception:  # noqa: BLE001
                time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def _make_certs(self):
        d = self.dir
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        with open(os.path.join(d, "server.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")
        for cmd in (
                ["openssl", "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "2", "-subj", "/CN=mc-py-ca"],
                ["openssl", "req", *key, "-keyout", "server.key", "-out", "server.csr",
                 "-subj", "/CN=mc-py-etcd"],
                ["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey",
                 "ca.key", "-CAcreateserial", "-out", "server.crt", "-days", "2",
                 "-extfile", "server.ext"]):
            subprocess.run(cmd, cwd=d, check=True, capture_output=True)
        return os.path.join(d, "ca.crt")

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class HaMaster:
    def __init__(self, etcd, cluster, name, extra=()):
        self.metrics_port = free_port()
        self.proc = subprocess.Popen(
            [master_bin(), "--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port",
             str(self.metrics_port), "--etcd-endpoints", etcd.endpoint, "--cluster-id", cluster,
             "--name", name, "--leader-ttl-s", "2", *extra], stdout=subprocess.PIPE, text=True)
        assert "ready" in self.proc.stdout.readline()

    def metric(self, name):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[-1])
        except Exception:  # noqa: BLE001
            pass
        return None

    def serving(self):
        return self.proc.poll() is None and \
            self.metric('mooncake_store_master_role{role="serving"}') == 1

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wait_leader(masters, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in masters:
            if m.serving():
                return m
        time.sleep(0.05)
    return None


@pytest.fixture
def cluster(monkeypatch):
    etcd = Etcd()
    name = f"py-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", name)
    masters = [HaMaster(etcd, name, f"m{i}") for i in range(2)]
    yield etcd, masters
    for m in masters:
        m.close()
    etcd.close()


def test_etcd_address_and_failover(cluster):
    etcd, masters = cluster
    leader = wait_leader(masters)
    assert leader is not None
    # /get_all_segments: the standby answers 503 with an empty body (SGLang's check_server
    # reads only the body: empty = not ready), the leader 200.
    standby = [m for m in masters if m is not leader][0]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{standby.metrics_port}/get_all_segments",
                               timeout=5)
    assert e.value.code == 503 and e.value.read() == b""
    e.value.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{leader.metrics_port}/get_all_segments",
                                timeout=5) as r:
        assert r.status == 200
    s = store_mod.MooncakeDistributedStore()
    # put/get stage through the local buffer (upstream: local_buffer_size > 0).
    assert s.setup("pyha", "", 32 << 20, 16 << 20, "tcp", "", f"etcd://{etcd.endpoint}") == 0
    values = {f"ha/{i}": os.urandom(1000 + i) for i in range(50)}
    for k, v in values.items():
        assert s.put(k, v) == 0
    # Upserts replace values (some with a new size): after the failover the new leader rebuilds
    # the new values, not the old ones (records of the newer put win; the old are wiped).
    for i in range(0, 50, 3):
        k = f"ha/{i}"
        values[k] = os.urandom(500 + 7 * i)
        assert s.upsert(k, values[k]) == 0
    for k in ("ha/1", "ha/4"):
        assert s.get(k) == values[k]
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(10)
    t_kill = time.monotonic()
    other = [m for m in masters if m is not leader][0]
    # Reads retry by themselves within their deadline; the failover (a 2 s lease) may outlast
    # one deadline, so ask again until the new leader answers.
    got = b""
    while time.monotonic() < t_kill + 20 and got != values["ha/0"]:
        got = s.get("ha/0")
    assert got == values["ha/0"], "the object did not come back after the failover"
    assert other.serving()
    for k, v in values.items():
        assert s.get(k) == v, k
    assert s.put("after", b"x" * 4096) == 0
    assert s.get("after") == b"x" * 4096
    assert s.upsert("ha/0", b"y" * 300) == 0, "upserts work on the new leader"
    assert s.get("ha/0") == b"y" * 300
    assert other.metric("mooncake_store_failovers_total") >= 1
    assert other.metric("mooncake_store_objects_recovered_total") >= len(values)
    assert other.metric("mooncake_store_objects_revoked_total") == 0
    s.close()


def test_hung_leader_is_left_for_the_new_one(cluster):
    """The leader hangs (SIGSTOP: its tcp peer lives, it answers nothing). The client must leave it
    within a few heartbeats once etcd names the new leader, and report its records there, so that
    the new leader's rebuild ends well before its timeout (2 x TTL + 2 s = 6 s here) with every
    object back. Before,
    the client only left a master whose engine peer died or that answered "standby": it kept
    renewing its membership key, the new leader waited out its rebuild timeout and served without
    the client's objects, and every call took 5 s to fail with RPC_FAIL."""
    etcd, masters = cluster
    leader = wait_leader(masters)
    assert leader is not None
    other = [m for m in masters if m is not leader][0]
    s = store_mod.MooncakeDistributedStore()
    assert s.setup("pyhung", "", 32 << 20, 16 << 20, "tcp", "", f"etcd://{etcd.endpoint}") == 0
    values = {f"hung/{i}": os.urandom(2000 + i) for i in range(20)}
    for k, v in values.items():
        assert s.put(k, v) == 0
    stop_process(leader.proc.pid)
    try:
        t_stop = time.monotonic()
        rc = None
        while time.monotonic() < t_stop + 20 and rc != 0:
            rc = s.put("after", b"a" * 3000)
        assert rc == 0, f"no put succeeded within 20 s of the leader hanging (last rc {rc})"
        assert other.serving()
        rebuild_s = other.metric("mooncake_store_rebuild_duration_seconds")
        assert rebuild_s is not None and rebuild_s < 4, \
            f"the new leader waited {rebuild_s} s for this client's report"
        for k, v in values.items():
            assert s.get(k) == v, k
        t = time.monotonic()
        assert s.put("after2", b"b" * 3000) == 0
        assert time.monotonic() - t < 2, "a put on the new leader is fast"
        assert other.metric("mooncake_store_objects_recovered_total") >= len(values)
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    # The old leader resumes, finds its lease gone and stands by; the client stays.
    time.sleep(1)
    assert s.put("after3", b"c" * 3000) == 0
    assert s.get("after") == b"a" * 3000
    s.close()


def test_unreachable_etcd_is_a_clear_error():
    s = store_mod.MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = s.setup("pyha", "", 1 << 20, 0, "tcp", "", f"etcd://127.0.0.1:{free_port()}")
    assert rc == E.ETCD_OPERATION_ERROR
    assert time.monotonic() - t0 < 10
    assert "etcd" in s._c.last_error()


def test_retryable_codes_are_named():
    assert E.UNAVAILABLE_IN_CURRENT_STATUS == -1010
    assert E.UNAVAILABLE_IN_CURRENT_MODE == -1011
    assert E.ETCD_OPERATION_ERROR == -1000


def test_python_client_over_an_https_etcd(monkeypatch):
    """etcd served over TLS: a master given its CA (--etcd-ca-file) leads, and a Python client
    finds it through etcd://https://host:port with MC_ETCD_CA_FILE; without the CA the client's
    setup fails naming the certificate check."""
    etcd = Etcd(tls=True)
    name = f"pytls-{os.getpid()}"
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", name)
    master = None
    try:
        master = HaMaster(etcd, name, "m0", extra=("--etcd-ca-file", etcd.ca))
        assert wait_leader([master]) is master
        address = f"etcd://https://{etcd.endpoint}"
        s = store_mod.MooncakeDistributedStore()
        assert s.setup("pytls", "", 1 << 20, 0, "tcp", "", address) != 0
        assert "verification" in s._c.last_error(), s._c.last_error()
        monkeypatch.setenv("MC_ETCD_CA_FILE", etcd.ca)
        s = store_mod.MooncakeDistributedStore()
        assert s.setup("pytls", "", 32 << 20, 16 << 20, "tcp", "", address) == 0, \
            s._c.last_error()
        assert s.put("k", b"over tls") == 0
        assert s.get("k") == b"over tls"
        s.close()
    finally:
        if master:
            master.close()
        etcd.close()

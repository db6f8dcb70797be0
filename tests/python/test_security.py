"""Security and robustness by default, tried the way an attacker on this host would (each test is
one finding of the security issue; docs/security.md): no unauthenticated access to a master or a
torch rank, listeners on loopback unless asked otherwise, bounded cost before authentication,
no spinning when file descriptors run out, linear-time regex, dead clients off the placement
list at once, bogus buffers refused, /health answering while idle connections sit on it."""
import hashlib
import hmac
import os
import resource
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Holder, Master, free_port, master_bin  # noqa: E402

store_mod = pytest.importorskip("mooncake.store")
MooncakeDistributedStore = store_mod.MooncakeDistributedStore
ReplicateConfig = store_mod.ReplicateConfig
E = store_mod.ErrorCode

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- the engine's and the rendezvous' wire formats (engine/transport/tcp/tcp_transport.h,
# engine/rendezvous.cc), spoken by hand as a raw client would; the proofs of the secret made
# with Python's hmac (engine/hmac.h's secretProof) ----
MAGIC = 0x4D435446
HELLO, HELLO_OK, HELLO_DENIED, WRITE, WRITE_ACK, READ_REQ, READ_RESP, NOTIFY, MSG = range(1, 10)
DESC, CHALLENGE, HELLO_PROOF = 11, 14, 15
WITH_PAYLOAD = {HELLO_DENIED, READ_RESP, MSG, DESC, CHALLENGE, HELLO_PROOF}


def frame(ftype, length=0, addr=0, req=1, aux=0, payload=b""):
    return struct.pack("<IBBHQQQQ", MAGIC, ftype, 0, 0, req, addr, length, aux) + payload


def engine_frames(data):
    """The engine frames in `data`: [(type, aux, payload)] (a bad magic ends the list)."""
    out, off = [], 0
    while off + 40 <= len(data):
        magic, ftype, _, _, _, _, length, aux = struct.unpack_from("<IBBHQQQQ", data, off)
        if magic != MAGIC:
            break
        off += 40
        body = b""
        if ftype in WITH_PAYLOAD:
            body = data[off:off + length]
            off += length
        out.append((ftype, aux, body))
    return out


def wstr(b):
    return struct.pack("<I", len(b)) + b


def proof(secret, role, challenge, nonce, bound=b""):
    msg = role + b"\0" + challenge + b"\0" + nonce + b"\0" + bound
    return hmac.new(secret, msg, hashlib.sha256).digest()


def hello_payload(secret, challenge, engine_id=0x1234, role=0, link=0x5eed):
    """A HELLO answering `challenge` with a proof made with `secret`: (payload, nonce, bound)."""
    nonce = os.urandom(32)
    bound = struct.pack("<QBQI", engine_id, role, link, 0 if role != 1 else 1)
    p = proof(secret, b"mooncake tcp v1 initiator", challenge, nonce, bound)
    return wstr(nonce) + wstr(p) + bound, nonce, bound


def rdv_request(op, key=b"", value=b"", timeout_ms=0):
    body = struct.pack("<B", op) + wstr(key) + wstr(value) + struct.pack("<Q", timeout_ms)
    return struct.pack("<I", len(body)) + body


def rdv_replies(data):
    """The rendezvous responses in `data`: [(code, value)]."""
    out, off = [], 0
    while off + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, off)
        body = data[off + 4:off + 4 + n]
        if len(body) < 5 or len(body) != n:
            break
        (vlen,) = struct.unpack_from("<I", body, 1)
        out.append((body[0], body[5:5 + vlen]))
        off += 4 + n
    return out


def recv_exact(s, n):
    got = b""
    while len(got) < n:
        b = s.recv(n - len(got))
        if not b:
            raise ConnectionError("closed")
        got += b
    return got


RDV_GET, RDV_AUTH = 2, 5


def connect(port, host="127.0.0.1"):
    s = socket.create_connection((host, port), timeout=5)
    s.settimeout(5)
    return s


def read_all(s, timeout=3.0):
    """Everything the peer sends until it closes (or the timeout): (bytes, closed)."""
    s.settimeout(timeout)
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return got, True
            got += b
    except socket.timeout:
        return got, False
    except ConnectionResetError:
        return got, True


def listening(pid):
    """(address, port) of every listening tcp socket of process `pid`."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                addr_hex, port_hex = cols[1].split(":")
                if v6:
                    raw = bytes.fromhex(addr_hex)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    addr = socket.inet_ntop(socket.AF_INET6, raw)
                else:
                    addr = socket.inet_ntoa(struct.pack("<I", int(addr_hex, 16)))
                out.append((addr, int(port_hex, 16)))
    return out


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        cols = f.read().rsplit(")", 1)[1].split()
    return (int(cols[11]) + int(cols[12])) / os.sysconf("SC_CLK_TCK")


def probe_engine_and_rendezvous(port):
    """What an unauthenticated raw client gets from `port`: a list of findings (empty: nothing)."""
    findings = []
    # A READ_REQ aimed at low memory before any HELLO: must be closed unanswered (an engine
    # sends its CHALLENGE first, nothing else).
    s = connect(port)
    s.sendall(frame(READ_REQ, length=64, addr=0x10000))
    data, closed = read_all(s)
    s.close()
    if any(t == READ_RESP for t, _, _ in engine_frames(data)):
        findings.append(f"port {port}: READ_REQ before HELLO answered")
    # A rendezvous GET before AUTH: must not return a value (a rendezvous sends its challenge
    # first, nothing else).
    s = connect(port)
    s.sendall(rdv_request(RDV_GET, b"mc/seg/mooncake-master"))
    data, closed = read_all(s)
    s.close()
    if any(code == 0 for code, _ in rdv_replies(data)[1:]):
        findings.append(f"port {port}: rendezvous GET before AUTH answered")
    return findings


def is_engine_port(port, secret):
    """True when `port` speaks the engine protocol and denies `secret`."""
    s = connect(port)
    try:
        first = engine_frames(recv_exact(s, 40 + 32))  # an engine's CHALLENGE comes at once
    except (OSError, ConnectionError):
        first = []
    if not first or first[0][0] != CHALLENGE:
        s.close()
        return False
    p, _, _ = hello_payload(secret, first[0][2])
    s.sendall(frame(HELLO, length=len(p), payload=p))
    data, _ = read_all(s)
    s.close()
    return any(t == HELLO_DENIED for t, _, _ in engine_frames(data))


def rdv_auth(port, secret):
    """Authenticates to the rendezvous at `port` with `secret`, checking the server's proof:
    (answer code, server proof checks out)."""
    s = connect(port)
    try:
        (n,) = struct.unpack("<I", recv_exact(s, 4))
        [(code, challenge)] = rdv_replies(struct.pack("<I", n) + recv_exact(s, n))
        assert code == 0 and len(challenge) == 32, (code, challenge)
        nonce = os.urandom(32)
        s.sendall(rdv_request(RDV_AUTH, value=nonce + proof(
            secret, b"mooncake rendezvous v1 client", challenge, nonce)))
        data, _ = read_all(s, timeout=1.0)
        replies = rdv_replies(data)
        if not replies:
            return None, False
        code, server = replies[0]
        return code, server == proof(secret, b"mooncake rendezvous v1 server", challenge, nonce)
    finally:
        s.close()


# ---------------------------------------------------------------- 1: master, default config

def test_master_listens_on_loopback_and_serves_no_one_without_the_secret():
    for host_flag in (False, True):  # without --host, and with --host 127.0.0.1
        m = Master(host_flag=host_flag)
        try:
            ports = listening(m.pid)
            assert len(ports) >= 2, ports  # rendezvous + engine
            assert all(a == "127.0.0.1" for a, _ in ports), ports
            findings = []
            engines = 0
            for _, port in ports:
                findings += probe_engine_and_rendezvous(port)
                engines += is_engine_port(port, b"wrong-secret")
            assert findings == []
            assert engines >= 1, "no port denied a wrong secret with HELLO_DENIED"
            # The rendezvous with the wrong secret: refused. With the job's: answered with the
            # server's proof, which Python's hmac checks (the C++ SHA-256 against another).
            code, _ = rdv_auth(m.port, b"wrong-secret")
            assert code != 0, code
            with open(os.environ["MC_SECRET_FILE"], "rb") as f:
                job_secret = f.readline().strip()
            assert rdv_auth(m.port, job_secret) == (0, True)
            # A client of another job (another secret) cannot set up, and says so at once (a
            # refused secret is not retried as a master still starting is, for 10 s); ours can.
            probe = ("import time; from mooncake.store import MooncakeDistributedStore as S;"
                     "t = time.monotonic();"
                     f"rc = S().setup('intruder', '', 1 << 20, 0, 'tcp', '', '{m.addr}');"
                     "print(rc, time.monotonic() - t)")
            env = dict(os.environ, MC_SECRET="another-jobs-secret-" + "0" * 32)
            r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0 and r.stdout.split()[:1] not in (["0"], []), \
                r.stdout + r.stderr
            assert "wrong job secret" in r.stderr, r.stderr[-2000:]
            assert float(r.stdout.split()[1]) < 5.0, r.stdout
            s = MooncakeDistributedStore()
            assert s.setup("owner", "", 1 << 20, 0, "tcp", "", m.addr) == 0
            s.close()
        finally:
            m.close()


# ---------------------------------------------------------------- 1: a torch rank

RANK = r"""
import os, sys, torch, torch.distributed as dist
import mooncake
rank, world = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("mooncake", rank=rank, world_size=world,
                        init_method=f"tcp://127.0.0.1:{sys.argv[3]}")
t = torch.full((1 << 16,), float(rank + 1))
dist.all_reduce(t)
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
t = torch.full((1 << 16,), float(rank + 1))
dist.all_reduce(t)
ok = bool((t == world * (world + 1) / 2).all())
print("result", ok, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.isolated
def test_torch_rank_serves_no_one_without_the_job_secret():
    world, port = 2, free_port()
    env = dict(os.environ)
    env.pop("MC_SECRET", None)
    env.pop("MC_SECRET_FILE", None)  # the group generates its secret
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        pids = []
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("ready"), line
            pids.append(int(line.split()[1]))
        for pid in pids:
            # Not torch's own TCPStore (on rank 0, all interfaces: torch's choice, not ours).
            ours = [(a, pp) for a, pp in listening(pid) if pp != port]
            assert ours, "rank has no listener"
            assert all(a == "127.0.0.1" for a, _ in ours), ours
            ports = [pp for _, pp in ours]
            findings = []
            for pp in ports:
                findings += probe_engine_and_rendezvous(pp)
            assert findings == []
            assert any(is_engine_port(pp, b"") for pp in ports)
            assert any(is_engine_port(pp, b"guess") for pp in ports)
        # The probes changed nothing: the next all_reduce is right on both ranks.
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "result True", line
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


# ---------------------------------------------------------------- 8: mismatched collectives

MISMATCH = r"""
import sys, time, torch, torch.distributed as dist
import mooncake
rank, world = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("mooncake", rank=rank, world_size=world,
                        init_method=f"tcp://127.0.0.1:{sys.argv[3]}",
                        timeout=__import__("datetime").timedelta(seconds=20))
cases = {
    "all_reduce 10 vs 20": lambda g: dist.all_reduce(torch.ones(20 if rank == 1 else 10), group=g),
    "all_reduce float32 vs int32": lambda g: dist.all_reduce(
        torch.ones(8, dtype=torch.int32 if rank == 1 else torch.float32), group=g),
    "all_reduce float32 vs float64": lambda g: dist.all_reduce(
        torch.ones(8, dtype=torch.float64 if rank == 0 else torch.float32), group=g),
    "broadcast 50 vs 100": lambda g: dist.broadcast(torch.ones(100 if rank == 1 else 50), 0, group=g),
    "all_gather 4 vs 6": lambda g: dist.all_gather(
        [torch.empty(6 if rank == 1 else 4) for _ in range(world)],
        torch.ones(6 if rank == 1 else 4), group=g),
}
for name, call in cases.items():
    g = dist.new_group(backend="mooncake")  # a mismatch breaks its group: one per case
    t0 = time.time()
    msg = "no error"
    try:
        call(g)
        try:
            dist.all_reduce(torch.ones(1), group=g)  # a rank that matched the root raises here
        except RuntimeError as e:
            msg = str(e)
    except RuntimeError as e:
        msg = str(e)
    print("CASE", name, "|", round(time.time() - t0, 2), "|", msg.replace("\n", " "), flush=True)
print("done", flush=True)
"""


@pytest.mark.isolated
def test_mismatched_collectives_raise_on_every_rank_naming_both_calls():
    world, port = 2, free_port()
    env = dict(os.environ)
    env.pop("MC_SECRET", None)
    env.pop("MC_SECRET_FILE", None)
    procs = [subprocess.Popen([sys.executable, "-c", MISMATCH, str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("mismatch job hung")
        outs.append((p.returncode, out, err[-3000:]))
    expect = {
        "all_reduce 10 vs 20": ("float32 x 10", "float32 x 20"),
        "all_reduce float32 vs int32": ("float32 x 8", "int32 x 8"),
        "all_reduce float32 vs float64": ("float32 x 8", "float64 x 8"),
        "broadcast 50 vs 100": ("broadcast(float32, 200 bytes", "broadcast(float32, 400 bytes"),
        "all_gather 4 vs 6": ("allgather(float32, 16 bytes", "allgather(float32, 24 bytes"),
    }
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0 and "done" in out, f"rank {r} rc={rc}\n{out}\n{err}"
        seen = {}
        for line in out.splitlines():
            if line.startswith("CASE "):
                name, took, msg = line[5:].split(" | ", 2)
                seen[name] = (float(took), msg)
        for name, subs in expect.items():
            took, msg = seen[name]
            assert took < 10, f"rank {r} {name}: raised after {took} s: {msg}"
            for sub in subs:
                assert sub.lower() in msg.lower(), f"rank {r} {name}: '{sub}' not in: {msg}"


# ---------------------------------------------------------------- 3: pre-auth floods

def test_preauth_floods_cost_no_memory_and_idle_connections_are_closed():
    m = Master(env={"MC_HANDSHAKE_TIMEOUT_MS": "1000"})
    try:
        engine_ports = [p for _, p in listening(m.pid) if p != m.port]
        base = rss_kib(m.pid)
        socks = []
        # 32 connections each announcing a 16 MiB HELLO and sending 1 MiB of it.
        for i in range(32):
            s = connect(engine_ports[0])
            s.setblocking(False)
            try:
                s.send(frame(HELLO, length=16 << 20) + b"x" * (1 << 20))
            except (BlockingIOError, ConnectionError, OSError):
                pass
            socks.append(s)
        # 16 announcing 64 MiB messages before any HELLO.
        for i in range(16):
            s = connect(engine_ports[0])
            try:
                s.send(frame(MSG, length=64 << 20) + b"y" * 65536)
            except OSError:
                pass
            socks.append(s)
        # The rendezvous: 16 announcing 32 MiB values before AUTH.
        for i in range(16):
            s = connect(m.port)
            s.setblocking(False)
            try:
                s.send(struct.pack("<I", 32 << 20) + b"z" * (1 << 20))
            except (BlockingIOError, ConnectionError, OSError):
                pass
            socks.append(s)
        time.sleep(0.5)
        grown = (rss_kib(m.pid) - base) / 1024
        assert grown < 64, f"master RSS grew {grown:.0f} MiB under pre-auth floods"
        for s in socks:
            s.close()
        # 500 idle connections: all closed by the handshake deadline (those beyond the
        # per-source limit at once).
        idle = []
        for i in range(500):
            try:
                idle.append(connect(engine_ports[0] if i % 2 else m.port))
            except OSError:
                pass
        time.sleep(2.5)
        open_ = 0
        for s in idle:
            s.setblocking(False)
            try:
                while s.recv(4096) != b"":  # the challenge it was sent, then its end
                    pass
            except BlockingIOError:
                open_ += 1
            except OSError:
                pass
            s.close()
        assert open_ == 0, f"{open_} of {len(idle)} idle connections still open after the deadline"
        assert (rss_kib(m.pid) - base) / 1024 < 64
        # And it still serves.
        s = MooncakeDistributedStore()
        assert s.setup("after-flood", "", 1 << 20, 16 << 20, "tcp", "", m.addr) == 0
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
        s.close()
    finally:
        m.close()


# ---------------------------------------------------------------- 4: out of file descriptors

def _limit_fds():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_master_out_of_fds_does_not_spin_and_keeps_serving():
    # Many sources would get past the per-source limit; one source stands in for them.
    m = Master(env={"MC_MAX_PREAUTH_PER_SOURCE": "100000", "MC_MAX_PREAUTH": "100000",
                    "MC_HANDSHAKE_TIMEOUT_MS": "60000"}, preexec_fn=_limit_fds)
    h = Holder(m.addr, 16 << 20)
    s = MooncakeDistributedStore()
    flood = []
    try:
        assert s.setup("existing", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        assert s.put("hot", b"h" * 4096) == 0
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        engine_port = [p for _, p in listening(m.pid) if p != m.port][0]
        for i in range(400):
            try:
                flood.append(connect(engine_port if i % 2 else m.port))
            except OSError:
                break
        time.sleep(0.5)
        c0 = cpu_seconds(m.pid)
        lat = []
        t_end = time.time() + 2.0
        while time.time() < t_end:
            t0 = time.perf_counter()
            assert s.get("hot") == b"h" * 4096
            lat.append(time.perf_counter() - t0)
            time.sleep(0.005)
        cpu = cpu_seconds(m.pid) - c0
        lat.sort()
        p99 = lat[int(len(lat) * 0.99) - 1]
        assert cpu < 1.0, f"master used {cpu:.2f} s of CPU in 2 s while out of descriptors"
        assert p99 < 0.05, f"get p99 {p99 * 1e3:.1f} ms while the master is out of descriptors"
        # A new client gets an answer (refused or served) promptly, not a hang.
        t0 = time.time()
        probe = ("from mooncake.store import MooncakeDistributedStore as S;"
                 f"print(S().setup('late', '', 0, 0, 'tcp', '', '{m.addr}'))")
        subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
        assert time.time() - t0 < 30
    finally:
        for f in flood:
            f.close()
        s.close()
        h.close()
        m.close()


# ---------------------------------------------------------------- 6: regex

def test_remove_by_regex_is_linear_time():
    m = Master()
    h = Holder(m.addr, 8 << 20)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("regex", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        assert s.put("a" * 28, b"x") == 0
        assert s.put("keep", b"y") == 0
        t0 = time.time()
        assert s.remove_by_regex("(a|a)*b") == 0
        assert time.time() - t0 < 1.0
        assert s.remove_by_regex("^a+$") == 1
        assert s.is_exist("keep") == 1
        assert s.remove_by_regex("(") == E.INVALID_PARAMS
        assert s.remove_by_regex("x" * 5000) == E.INVALID_PARAMS
    finally:
        s.close()
        h.close()
        m.close()


# ---------------------------------------------------------------- 7: a dead client

def test_replicas_avoid_a_killed_client_within_a_second():
    m = Master()  # client TTL 10 s: expiry cannot be what saves the puts
    a = Holder(m.addr, 64 << 20)
    b = Holder(m.addr, 64 << 20)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("writer", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        for i in range(20):
            assert s.put(f"before/{i}", os.urandom(16384)) == 0
        b.kill()
        time.sleep(1.0)
        fails = sum(s.put(f"after/{i}", b"p" * 16384) != 0 for i in range(300))
        assert fails == 0, f"{fails} of 300 puts failed 1 s after a holder died"
        assert s.get("after/7") == b"p" * 16384
    finally:
        s.close()
        a.close()
        m.close()


# ---------------------------------------------------------------- 9: bogus buffers

def test_register_of_unmapped_memory_is_refused():
    m = Master()
    h = Holder(m.addr, 8 << 20)
    s = MooncakeDistributedStore()
    try:
        assert s.setup("bogus", "", 0, 16 << 20, "tcp", "", m.addr) == 0
        assert s.register_buffer(0x10000, 4096) == E.INVALID_PARAMS
        assert s.put("obj", b"q" * 4096) == 0
        assert s.get_into("obj", 0x10000, 4096) < 0  # refused, no crash
        import ctypes
        buf = ctypes.create_string_buffer(4096)
        assert s.register_buffer(ctypes.addressof(buf), 4096) == 0
        assert s.get_into("obj", ctypes.addressof(buf), 4096) == 4096
        assert buf.raw == b"q" * 4096
    finally:
        s.close()
        h.close()
        m.close()


# ---------------------------------------------------------------- 11: /health

def test_health_answers_fast_while_idle_connections_sit_on_the_port():
    mport = free_port()
    m = Master("--metrics-port", str(mport))
    idle = []
    try:
        url = f"http://127.0.0.1:{mport}/health"
        assert urllib.request.urlopen(url, timeout=5).read().strip() == b"OK"
        for i in range(16):
            c = connect(mport)
            if i % 2:
                c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            idle.append(c)
        time.sleep(0.2)
        worst = 0.0
        for _ in range(10):
            t0 = time.perf_counter()
            assert urllib.request.urlopen(url, timeout=5).read().strip() == b"OK"
            worst = max(worst, time.perf_counter() - t0)
        assert worst < 0.1, f"/health took {worst * 1e3:.0f} ms with 16 idle connections open"
    finally:
        for c in idle:
            c.close()
        m.close()


def _health(mport):
    url = f"http://127.0.0.1:{mport}/health"
    return urllib.request.urlopen(url, timeout=5).read().strip()


def test_status_port_takes_no_request_body():
    """A request announcing a body (any method, any route) is answered 413 and closed without
    the body being read into memory; other methods than GET/HEAD are 405."""
    mport = free_port()
    m = Master("--metrics-port", str(mport))
    try:
        assert _health(mport) == b"OK"
        base = rss_kib(m.pid)
        for head in (b"POST /metrics", b"GET /health", b"PUT /get_all_segments"):
            c = connect(mport)
            c.sendall(head + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000000\r\n\r\n")
            sent = 0
            try:
                while sent < (64 << 20):  # streamed; the master must not keep it
                    sent += c.send(b"\0" * (1 << 20))
            except OSError:
                pass  # closed under us: what the master should do
            c.close()
        grown = rss_kib(m.pid) - base
        assert grown < 16 << 10, f"the master grew by {grown} KiB taking 3 bodies of 64 MiB"
        c = connect(mport)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        reply, closed = read_all(c)
        c.close()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert closed
        c = connect(mport)
        c.sendall(b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply, closed = read_all(c)
        c.close()
        assert reply.startswith(b"HTTP/1.1 405"), reply[:200]
        assert _health(mport) == b"OK"
    finally:
        m.close()


def test_health_answers_while_clients_trickle_their_headers():
    """100 clients each sending a header line every 0.3 s (never finishing their request) hold
    no worker: /health still answers at once, and each trickler is closed within 2 s."""
    mport = free_port()
    m = Master("--metrics-port", str(mport))
    socks = []
    try:
        assert _health(mport) == b"OK"
        for _ in range(100):
            c = connect(mport)
            c.sendall(b"GET /metrics HTTP/1.1\r\n")
            socks.append(c)
        worst = 0.0
        t_start = time.perf_counter()
        while time.perf_counter() - t_start < 1.5:
            for c in socks:
                try:
                    c.send(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            t0 = time.perf_counter()
            assert _health(mport) == b"OK"
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.3)
        assert worst < 0.5, f"/health took {worst * 1e3:.0f} ms beside 100 trickling clients"
        time.sleep(1.0)  # past the 2 s each connection gets
        still_open = 0
        for c in socks:
            try:
                c.send(b"X-Slow: 1\r\n")
                _, closed = read_all(c, timeout=0.05)
                still_open += not closed
            except OSError:
                pass
        assert still_open == 0, f"{still_open} trickling connections outlived their 2 s"
    finally:
        for c in socks:
            c.close()
        m.close()


def test_status_port_answers_the_request_forms_clients_send():
    """HTTP/1.0, HEAD, bare-LF line ends, empty lines before the request line and the absolute
    form a proxy sends are all answered; the answer closes the connection."""
    mport = free_port()
    m = Master("--metrics-port", str(mport))
    try:
        assert _health(mport) == b"OK"
        for req, status, body in (
                (b"GET /health HTTP/1.0\r\n\r\n", b"200", b"OK\n"),
                (b"GET /health HTTP/1.1\n\n", b"200", b"OK\n"),
                (b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"200", b"OK\n"),
                (b"GET http://x:1/health?probe=1 HTTP/1.1\r\nHost: x\r\n\r\n", b"200", b"OK\n"),
                (b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", b"200", b""),
                (b"GET /nope HTTP/1.1\r\n\r\n", b"404", None),
                (b"NONSENSE\r\n\r\n", b"400", None)):
            c = connect(mport)
            c.sendall(req)
            reply, closed = read_all(c)
            c.close()
            assert reply.startswith(b"HTTP/1.1 " + status), (req, reply[:200])
            assert closed, req
            if body is not None:
                assert reply.split(b"\r\n\r\n", 1)[1] == body, (req, reply)
    finally:
        m.close()

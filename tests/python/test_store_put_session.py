"""Put sessions, upstream's layer-wise save API (vLLM's MooncakeStoreConnector and vllm-ascend
call batch_put_session_start, batch_put_from_multi_buffer_ranges per layer,
batch_put_session_end / _revoke), against a running master and a holder process: objects
written range by range from registered memory into replicas in this client's segment and in
the holder's, invisible until the end and whole after it; every refusal (no session, a second
start, a range past the object, an unregistered source, bytes never written); revoke, and a
client that closes with a session open; a master restarted under an open session (a published one is
rebuilt from its records, the open one is refused), and a session older than the master's
release timeout. And the layer-wise load's batched ranged reads (one replica-list call and one
engine batch for all keys) falling back to a key's other replica when its first holder died."""
import ctypes
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_common import Holder, Master, master_bin  # noqa: E402

store_mod = pytest.importorskip("mooncake.store")
MooncakeDistributedStore = store_mod.MooncakeDistributedStore
ReplicateConfig = store_mod.ReplicateConfig
E = store_mod.ErrorCode

pytestmark = pytest.mark.skipif(master_bin() is None, reason="mooncake_master not built")
MiB = 1 << 20


def registered(s, data):
    buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
    assert s.register_buffer(ctypes.addressof(buf), len(data)) == 0
    return buf, ctypes.addressof(buf)


@pytest.fixture(scope="module")
def env():
    m = Master(env={"MC_STORE_LEASE_TTL_MS": "1000"})  # short read leases (replica clear)
    h = Holder(m.addr, 32 * MiB)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "", 16 * MiB, 16 * MiB, "tcp", "", m.addr) == 0
    r = MooncakeDistributedStore()  # a reader with no segment of its own
    assert r.setup("127.0.0.1", "", 0, 16 * MiB, "tcp", "", m.addr) == 0
    yield m, h, s, r
    r.close()
    s.close()
    h.close()
    m.close()


def test_layerwise_save(env):
    _, _, s, r = env
    layers, page, keys = 4, 6000, ["ps/a", "ps/b", "ps/c"]
    size = layers * 2 * page  # per layer a K page and a V page
    # The KV cache as the model holds it: per layer, K of every key, then V of every key.
    cache = os.urandom(layers * 2 * len(keys) * page)
    buf, p = registered(s, cache)

    def src(layer, kv, k):
        return ((layer * 2 + kv) * len(keys) + k) * page

    want = [b"".join(cache[src(l, kv, k):src(l, kv, k) + page]
                     for l in range(layers) for kv in range(2)) for k in range(len(keys))]
    two = ReplicateConfig()
    two.replica_num = 2  # one replica in this client's segment, one in the holder's
    assert s.batch_put_session_start(keys, [size] * 3, two) == [0, 0, 0]
    for layer in range(layers):
        got = s.batch_put_from_multi_buffer_ranges(
            keys, [[p + src(layer, 0, k), p + src(layer, 1, k)] for k in range(3)],
            [[page, page]] * 3, [[layer * 2 * page, (layer * 2 + 1) * page]] * 3)
        assert got == [2 * page] * 3
        # Nothing is readable before the end.
        assert r.is_exist("ps/a") == 0 and r.get("ps/a") == b""
    assert s.batch_put_session_end(keys) == [0, 0, 0]
    assert [r.get(k) for k in keys] == want
    # Both replicas hold every byte: drop the first, read the other.
    segs = [x.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for x in r.get_replica_desc("ps/b")]
    assert len(set(segs)) == 2
    time.sleep(1.2)  # the descriptor read took a read lease (1 s)
    assert s.batch_replica_clear(["ps/b"], segs[0]) == ["ps/b"]
    assert r.get("ps/b") == want[1]
    # Upstream's shorter names are the same calls.
    assert s.batch_put_start(["ps/d"], [page]) == [0]
    assert s.batch_put_from_multi_buffer_ranges(["ps/d"], [[p]], [[page]], [[0]]) == [page]
    assert s.batch_put_end(["ps/d"]) == [0]
    assert r.get("ps/d") == cache[:page]
    # By keyword: upstream's names, and all_buffers / all_offsets.
    for i, kw in enumerate(({"all_buffer_ptrs": [[p]], "all_dst_offsets": [[0]]},
                            {"all_buffers": [[p]], "all_offsets": [[0]]})):
        assert s.batch_put_start([f"ps/kw{i}"], [page]) == [0]
        assert s.batch_put_from_multi_buffer_ranges(keys=[f"ps/kw{i}"], all_sizes=[[page]],
                                                    **kw) == [page]
        assert s.batch_put_end([f"ps/kw{i}"]) == [0]
        assert r.get(f"ps/kw{i}") == cache[:page]
    assert s.unregister_buffer(p) == 0


def test_refusals(env):
    _, _, s, r = env
    data = os.urandom(8192)
    buf, p = registered(s, data)
    loose = (ctypes.c_ubyte * 4096)()  # never registered
    assert s.put("ps/exists", b"x" * 10) == 0
    assert s.batch_put_session_start(["ps/exists", "ps/e1", "ps/e1", ""], [10, 8192, 8192, 5]) \
        == [E.OBJECT_ALREADY_EXISTS, 0, E.OBJECT_ALREADY_EXISTS, E.INVALID_KEY]
    # This client's own open session: INVALID_PARAMS, as upstream (-705 would tell a caller
    # such as vllm-ascend that another writer holds the key).
    assert s.batch_put_session_start(["ps/e1", "ps/e2"], [8192, 8192]) == [E.INVALID_PARAMS, 0]
    assert s.batch_put_session_revoke(["ps/e2"]) == [0]
    assert s.batch_put_session_start(["ps/zero"], [0]) == [E.INVALID_PARAMS]
    assert s.batch_put_session_start(["ps/short"], [1, 2]) == [E.INVALID_PARAMS]
    # Per key, each refusal writes nothing of that key and leaves the session as it was.
    assert s.batch_put_from_multi_buffer_ranges(
        ["ps/none", "ps/e1", "ps/e1", "ps/e1", "ps/e1"],
        [[p], [p], [p, p], [ctypes.addressof(loose)], [p]],
        [[8], [4096], [8], [4096], [0]],
        [[0], [8192 - 4095], [0], [0], [0]]) == \
        [E.OBJECT_NOT_FOUND, E.INVALID_PARAMS, E.INVALID_PARAMS, E.INVALID_PARAMS,
         E.INVALID_PARAMS]
    # Bytes never written: the end refuses, the session stays open for the rest.
    assert s.batch_put_from_multi_buffer_ranges(["ps/e1"], [[p]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_end(["ps/e1"]) == [E.INVALID_WRITE]
    assert r.is_exist("ps/e1") == 0
    # Overlapping ranges count once; the last write of a byte wins.
    assert s.batch_put_from_multi_buffer_ranges(
        ["ps/e1", "ps/e1"], [[p + 4000], [p + 4096]], [[4192], [4096]], [[4000], [4096]]) == \
        [4192, 4096]
    assert s.batch_put_session_end(["ps/e1", "ps/e1", "ps/never"]) == \
        [0, E.OBJECT_NOT_FOUND, E.OBJECT_NOT_FOUND]
    assert r.get("ps/e1") == data
    # A published key's session is gone.
    assert s.batch_put_from_multi_buffer_ranges(["ps/e1"], [[p]], [[8]], [[0]]) == \
        [E.OBJECT_NOT_FOUND]
    # One end call for several keys: each on its own (one incomplete stays open).
    assert s.batch_put_session_start(["ps/m1", "ps/m2"], [100, 100]) == [0, 0]
    assert s.batch_put_from_multi_buffer_ranges(["ps/m1", "ps/m2"], [[p], [p]], [[100], [50]],
                                                [[0], [0]]) == [100, 50]
    assert s.batch_put_session_end(["ps/m2", "ps/m1"]) == [E.INVALID_WRITE, 0]
    assert r.get("ps/m1") == data[:100] and r.is_exist("ps/m2") == 0
    assert s.batch_put_from_multi_buffer_ranges(["ps/m2"], [[p + 50]], [[50]], [[50]]) == [50]
    assert s.batch_put_session_end(["ps/m2"]) == [0]
    assert r.get("ps/m2") == data[:100]
    assert s.unregister_buffer(p) == 0


def test_revoke_and_close(env):
    m, _, s, r = env
    data = os.urandom(4096)
    buf, p = registered(s, data)
    assert s.batch_put_session_start(["ps/rv"], [4096]) == [0]
    assert s.batch_put_from_multi_buffer_ranges(["ps/rv"], [[p]], [[2048]], [[0]]) == [2048]
    assert s.batch_put_session_revoke(["ps/rv", "ps/rv"]) == [0, E.OBJECT_NOT_FOUND]
    assert s.batch_put_session_end(["ps/rv"]) == [E.OBJECT_NOT_FOUND]
    assert r.is_exist("ps/rv") == 0
    # The master dropped the unfinished put: the key can be written again at once (an
    # unfinished put blocks its key for MC_STORE_PUT_DISCARD_TIMEOUT_S, 30 s).
    assert s.batch_put_session_start(["ps/rv"], [4096]) == [0]
    assert s.batch_put_from_multi_buffer_ranges(["ps/rv"], [[p]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_end(["ps/rv"]) == [0]
    assert r.get("ps/rv") == data
    # A client that closes with a session open revokes it.
    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", "", 0, 4 * MiB, "tcp", "", m.addr) == 0
    assert c.batch_put_session_start(["ps/left"], [100]) == [0]
    c.close()
    assert r.is_exist("ps/left") == 0
    assert s.batch_put_session_start(["ps/left"], [100]) == [0]
    assert s.batch_put_session_revoke(["ps/left"]) == [0]
    assert s.unregister_buffer(p) == 0


def test_master_restart_ends_open_sessions():
    m = Master()
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 16 * MiB, 4 * MiB, "tcp", "", m.addr) == 0
        data = os.urandom(4096)
        buf, p = registered(s, data)
        # One object published through a session, one left open.
        assert s.batch_put_session_start(["ps/kept", "ps/fo"], [4096, 4096]) == [0, 0]
        assert s.batch_put_from_multi_buffer_ranges(["ps/kept", "ps/fo"], [[p], [p]],
                                                    [[4096], [1024]], [[0], [0]]) == [4096, 1024]
        assert s.batch_put_session_end(["ps/kept"]) == [0]
        port = m.port
        m.close()
        m = Master(port=port)  # a new master where the client looks for it
        deadline = time.time() + 15
        while s.is_exist("ps/probe") != 0 and time.time() < deadline:
            time.sleep(0.1)  # (0 once the client reached the new master)
        # The new master may have placed other objects where this one was to go: no more
        # writes, and no end.
        assert s.batch_put_from_multi_buffer_ranges(["ps/fo"], [[p + 1024]], [[3072]],
                                                    [[1024]]) == [E.RPC_FAIL]
        assert s.batch_put_session_end(["ps/fo"]) == [E.RPC_FAIL]
        assert s.is_exist("ps/fo") == 0
        # The published one came back with the client's report (its records were committed).
        assert s.get("ps/kept") == data
        # The key is free on the new master.
        assert s.batch_put_session_start(["ps/fo"], [4096]) == [0]
        assert s.batch_put_from_multi_buffer_ranges(["ps/fo"], [[p]], [[4096]], [[0]]) == [4096]
        assert s.batch_put_session_end(["ps/fo"]) == [0]
        assert s.get("ps/fo") == data
        s.close()
    finally:
        m.close()


def test_session_past_the_release_timeout():
    # The master takes an unfinished put's memory back after MC_STORE_PUT_RELEASE_TIMEOUT_S:
    # a range that could still be landing by then is refused.
    m = Master(env={"MC_STORE_PUT_RELEASE_TIMEOUT_S": "12"})
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 16 * MiB, 4 * MiB, "tcp", "", m.addr) == 0
        buf, p = registered(s, b"y" * 4096)
        assert s.batch_put_session_start(["ps/old"], [4096]) == [0]
        # 12 s less the client's transfer deadline (StoreClientOptions' default, 10 s): ranges
        # may start for 2 s.
        assert s.batch_put_from_multi_buffer_ranges(["ps/old"], [[p]], [[1024]], [[0]]) == [1024]
        time.sleep(2.5)
        assert s.batch_put_from_multi_buffer_ranges(["ps/old"], [[p]], [[4096]], [[0]]) == \
            [E.LEASE_EXPIRED]
        # The end writes the records into the put's memory too: refused, and it revokes.
        assert s.batch_put_session_end(["ps/old"]) == [E.LEASE_EXPIRED]
        assert s.batch_put_session_revoke(["ps/old"]) == [E.OBJECT_NOT_FOUND]
        assert s.is_exist("ps/old") == 0
        assert s.batch_put_session_start(["ps/old"], [4096]) == [0]  # the key is free
        assert s.batch_put_session_revoke(["ps/old"]) == [0]
        s.close()
    finally:
        m.close()


def test_batched_range_reads_fall_back_to_the_other_replica():
    # batch_get_into_multi_buffer_ranges reads the first replica of every key in one engine
    # batch; a key whose first replica's holder died reads its other replica.
    m = Master()
    a, b = Holder(m.addr, 16 * MiB), Holder(m.addr, 16 * MiB)
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 4 * MiB, "tcp", "", m.addr) == 0
        two = ReplicateConfig()
        two.replica_num = 2
        vals = {f"fb/{i}": os.urandom(3000 + i) for i in range(6)}
        for k, v in vals.items():
            assert s.put(k, v, two) == 0
        first = {k: s.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor
                 .transport_endpoint for k in vals}
        dead = a if first["fb/0"] == a.name else b
        # A read session's lists name the dead holder too: its reads fall back as well.
        assert s.batch_get_session_start(["fb/0", "fb/1"]) == [0, 0]
        dead.kill()
        buf = (ctypes.c_ubyte * (6 * 4096))()
        assert s.register_buffer(ctypes.addressof(buf), len(buf)) == 0
        keys = list(vals)
        p = ctypes.addressof(buf)
        got = s.batch_get_into_multi_buffer_ranges(
            keys, [[p + i * 4096, p + i * 4096 + 100] for i in range(6)],
            [[100, len(vals[k]) - 100] for k in keys], [[0, 100] for _ in keys])
        assert got == [len(vals[k]) for k in keys]
        assert [bytes(buf[i * 4096:i * 4096 + len(vals[k])]) for i, k in enumerate(keys)] == \
            [vals[k] for k in keys]
        s.close()
    finally:
        a.close()
        b.close()
        m.close()


def test_a_put_that_took_the_key_over_is_not_ended_or_revoked_by_the_session():
    # An unfinished put older than MC_STORE_PUT_DISCARD_TIMEOUT_S may be taken over by another
    # put of its key, this client's own included. The session's end and revoke name their put
    # (PutStartResponse.put_token): they must not end or drop the put that took over.
    m = Master(env={"MC_STORE_PUT_DISCARD_TIMEOUT_S": "1"})
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 16 * MiB, 4 * MiB, "tcp", "", m.addr) == 0
        buf, p = registered(s, b"s" * 4096)
        assert s.batch_put_session_start(["ps/t1", "ps/t2"], [4096, 4096]) == [0, 0]
        assert s.batch_put_from_multi_buffer_ranges(["ps/t1", "ps/t2"], [[p], [p]], [[4096]] * 2,
                                                    [[0], [0]]) == [4096, 4096]
        time.sleep(1.3)
        assert s.put("ps/t1", b"new value 1") == 0  # takes the key over
        assert s.put("ps/t2", b"new value 2") == 0
        assert s.batch_put_session_end(["ps/t1"]) == [E.OBJECT_NOT_FOUND]
        assert s.batch_put_session_revoke(["ps/t2"]) == [E.OBJECT_NOT_FOUND]
        assert s.get("ps/t1") == b"new value 1" and s.get("ps/t2") == b"new value 2"
        s.close()
    finally:
        m.close()


def test_ranges_wait_for_a_master_that_stopped_answering():
    # A master silent for half the client TTL may be expiring this client (and then frees its
    # unfinished puts' memory): ranges are refused until a heartbeat is answered again.
    m = Master("--client-ttl-s", "2")
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 16 * MiB, 4 * MiB, "tcp", "", m.addr) == 0
        data = os.urandom(4096)
        buf, p = registered(s, data)
        assert s.batch_put_session_start(["ps/hb"], [4096]) == [0]
        assert s.batch_put_from_multi_buffer_ranges(["ps/hb"], [[p]], [[1024]], [[0]]) == [1024]
        os.kill(m.pid, signal.SIGSTOP)
        try:
            time.sleep(1.6)
            assert s.batch_put_from_multi_buffer_ranges(["ps/hb"], [[p + 1024]], [[1024]],
                                                        [[1024]]) == [E.RPC_FAIL]
        finally:
            os.kill(m.pid, signal.SIGCONT)
        deadline = time.time() + 10
        while True:  # the next heartbeat is answered
            got = s.batch_put_from_multi_buffer_ranges(["ps/hb"], [[p + 1024]], [[3072]],
                                                       [[1024]])
            if got == [3072] or time.time() > deadline:
                break
            time.sleep(0.1)
        assert got == [3072]
        assert s.batch_put_session_end(["ps/hb"]) == [0]
        assert s.get("ps/hb") == data
        s.close()
    finally:
        m.close()


def test_read_session_reads_without_asking_the_master():
    # vLLM's layer-wise load: batch_get_session_start asks for every key's replica list once;
    # the range reads of the layers then make no master call while half the read lease is
    # left, and ask again after the session ended.
    import urllib.request

    from _store_common import free_port
    mport = free_port()
    m = Master("--metrics-port", str(mport), env={"MC_STORE_LEASE_TTL_MS": "4000"})
    h = Holder(m.addr, 16 * MiB)

    def lists_asked():
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith('mooncake_store_rpc_calls_total{method="BATCH_GET_REPLICA_LIST"}'):
                return int(float(line.split()[-1]))
        return 0

    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "", 0, 4 * MiB, "tcp", "", m.addr) == 0
        vals = [os.urandom(4096) for _ in range(4)]
        keys = [f"rs/{i}" for i in range(4)]
        for k, v in zip(keys, vals):
            assert s.put(k, v) == 0
        buf = (ctypes.c_ubyte * (4 * 4096))()
        p = ctypes.addressof(buf)
        assert s.register_buffer(p, len(buf)) == 0
        assert s.batch_get_session_start(keys + ["rs/missing"]) == [0] * 4 + [E.OBJECT_NOT_FOUND]
        before = lists_asked()
        for layer in range(4):
            assert s.batch_get_into_multi_buffer_ranges(
                keys, [[p + i * 4096 + layer * 1024] for i in range(4)], [[1024]] * 4,
                [[layer * 1024]] * 4) == [1024] * 4
        assert lists_asked() == before, "a range read of a read session asked the master"
        assert [bytes(buf[i * 4096:(i + 1) * 4096]) for i in range(4)] == vals
        assert s.batch_get_session_end(keys) == 0
        assert s.batch_get_into_multi_buffer_ranges(keys[:1], [[p]], [[8]], [[0]]) == [8]
        assert lists_asked() == before + 1
        # This client's own upsert of a key drops the key's session list.
        assert s.batch_get_session_start(keys[1:2]) == [0]
        assert s.upsert(keys[1], b"u" * 4096) == 0
        assert s.batch_get_into_multi_buffer_ranges(keys[1:2], [[p]], [[4096]], [[0]]) == [4096]
        assert bytes(buf[:4096]) == b"u" * 4096
        # A replaced value after the lease: a session started before it reads the new bytes
        # once half the lease passed (the lists are asked for again).
        assert s.batch_get_session_start(keys[:1]) == [0]
        time.sleep(4.2)  # the lease lapsed: the object may be replaced now
        assert s.remove(keys[0]) == 0 and s.put(keys[0], b"n" * 4096) == 0
        assert s.batch_get_into_multi_buffer_ranges(keys[:1], [[p]], [[4096]], [[0]]) == [4096]
        assert bytes(buf[:4096]) == b"n" * 4096
        s.close()
    finally:
        h.close()
        m.close()

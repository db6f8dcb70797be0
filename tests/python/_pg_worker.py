"""One rank of a harness.Pool: initialises a mooncake default group and a gloo group over
the same ranks, then runs the cases the pool sends until told to exit."""

import argparse
import faulthandler
import importlib
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctl-port", type=int, required=True)
    ap.add_argument("--authkey", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--no-gloo", action="store_true")
    a = ap.parse_args()
    # The pool sends SIGUSR1 to a rank that does not answer: every thread's stack goes to
    # this rank's log before it is killed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    conn = Client(("127.0.0.1", a.ctl_port), authkey=bytes.fromhex(a.authkey))
    conn.send(("hello", a.rank, os.getpid()))
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.master_port),
                          RANK=str(a.rank), WORLD_SIZE=str(a.world))
        import torch

        torch.set_num_threads(1)  # 2 cores, up to 4 ranks: no intra-op thread pools
        import torch.distributed as dist

        import mooncake  # noqa: F401  (registers the backend)

        dist.init_process_group("mooncake", init_method="env://", rank=a.rank,
                                world_size=a.world, timeout=timedelta(seconds=a.timeout_s))
        gloo = None if a.no_gloo else dist.new_group(backend="gloo")
        cases = [importlib.import_module(m) for m in ("pg_cases", "pg_cases_misc", "pg_cases_torch2", "pg_cases_gpu",
                                                         "pg_cases_gpu_p2p")]
        ctx = cases[0].Ctx(a.rank, a.world, gloo, a.timeout_s)
        conn.send(("ready", a.rank))
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return 1

    while True:
        try:
            kind, name, kwargs = conn.recv()
        except EOFError:
            return 0
        if kind == "exit":
            break
        try:
            fn = next(getattr(m, "case_" + name) for m in cases if hasattr(m, "case_" + name))
            conn.send(("ok", fn(ctx, **kwargs)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

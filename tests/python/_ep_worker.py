"""One rank of an EP test run: initialises the default group with backend "mooncake", runs the
named cases of ep_cases.py (or ep_cases_order.py, ep_cases_gpu.py, ep_cases_upstream.py) in
order and writes {case: failures | "error: ..."} as JSON after each case (so a rank killed on
purpose leaves what it had). Before it exits it waits (at most WAIT_PEERS_S) until every other
rank has finished its cases or is gone: a rank's last writes and notifications to a peer may
still be on their way when its own cases end, and an exit drops them (CI saw it once: rank 0
exited right after its last normal_combine over the verbs emulator and rank 1 never got rank
0's rows). Exits with os._exit so a dead peer cannot hang the teardown."""

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WAIT_PEERS_S = 30.0


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # (a zombie is gone for our purpose: its parent has not reaped it yet)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_peers(a, names):
    """Until every other rank has written all of `names` or its process is gone (bounded)."""
    deadline = time.monotonic() + WAIT_PEERS_S
    pending = set(range(a.world)) - {a.rank}
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            try:
                with open(f"{a.out}/rank{r}.json") as f:
                    theirs = json.load(f)
                done = all(n in theirs for n in names)
            except (OSError, ValueError):
                done = False
            try:
                with open(f"{a.out}/rank{r}.pid") as f:
                    gone = not _alive(int(f.read()))
            except (OSError, ValueError):
                gone = False
            if done or gone:
                pending.discard(r)
        time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {}
    with open(f"{a.out}/rank{a.rank}.pid.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{a.out}/rank{a.rank}.pid.tmp", f"{a.out}/rank{a.rank}.pid")

    def save():
        tmp = f"{a.out}/rank{a.rank}.json.tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, f"{a.out}/rank{a.rank}.json")

    try:
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        import mooncake  # noqa: F401
        import ep_cases
        import ep_cases_gpu
        import ep_cases_order
        import ep_cases_upstream

        dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world, timeout=timedelta(seconds=60))
        ctx = ep_cases.Ctx(a.rank, a.world, a.out)
    except BaseException:
        results["__init__"] = "error: " + traceback.format_exc()
        save()
        os._exit(1)
    names = a.cases.split(",")
    for name in names:
        try:
            case = (getattr(ep_cases, "case_" + name, None) or
                    getattr(ep_cases_order, "case_" + name, None) or
                    getattr(ep_cases_upstream, "case_" + name, None) or
                    getattr(ep_cases_gpu, "case_" + name))
            results[name] = case(ctx)
        except BaseException:
            results[name] = "error: " + traceback.format_exc()
        save()
    wait_for_peers(a, names)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

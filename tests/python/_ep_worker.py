"""One rank of an EP test run: initialises the default group with backend "mooncake", runs
the named cases of ep_cases.py in order and writes {case: failures | "error: ..."} as JSON
after each case (so a rank killed on purpose leaves what it had). Exits with os._exit so a
dead peer cannot hang the teardown."""

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {}

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

        dist.init_process_group("mooncake", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world, timeout=timedelta(seconds=60))
        ctx = ep_cases.Ctx(a.rank, a.world, a.out)
    except BaseException:
        results["__init__"] = "error: " + traceback.format_exc()
        save()
        os._exit(1)
    for name in a.cases.split(","):
        try:
            results[name] = getattr(ep_cases, "case_" + name)(ctx)
        except BaseException:
            results[name] = "error: " + traceback.format_exc()
        save()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

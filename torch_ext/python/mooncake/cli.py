"""The store's console scripts.

``mooncake_master`` runs the store master shipped in the package. The wheel carries the C++
binary as ``mooncake/mooncake_master`` (as upstream Mooncake's wheel does); this replaces the
Python process with it, so signals and the exit status are the binary's own. Usage and flags:
``mooncake_master --help`` and docs/store.md.

``mooncake_client`` is upstream's standalone client that lends memory to the store (vLLM's
``standalone-store`` mode: the serving ranks lend nothing, this process owns the pool). It takes
upstream's flags; see ``client_main``.
"""

import argparse
import os
import signal
import sys


def master_path():
    """Path of the mooncake_master binary installed with this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "mooncake_master")


def main(argv=None):
    path = master_path()
    if not os.access(path, os.X_OK):
        sys.exit(f"mooncake_master: {path} is missing or not executable; reinstall the package "
                 "(pip install .) or run the build tree's build/store/mooncake_master")
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    os.execv(path, [path] + args)


def _flag_bool(v):
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {v!r}")


_CLIENT_BOOLS = ("enable_offload", "start_offload_rpc_server", "enable_http_server")


def _gflags_style(args):
    """Upstream's flags are gflags: ``-flag`` as ``--flag``, ``--noflag`` for a false boolean."""
    out = []
    for a in args:
        if a.startswith("-") and not a.startswith("--") and len(a) > 2:
            a = "-" + a
        name = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if name.startswith("no") and name[2:] in _CLIENT_BOOLS and "=" not in a:
            a = f"--{name[2:]}=false"
        out.append(a)
    return out


def _host_part(host):
    """"h", "h:port", "[v6]" or "[v6]:port" -> "h" / "v6"."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else ""
    return host.partition(":")[0] if host.count(":") == 1 else host


def client_main(argv=None):
    """``mooncake_client``: lends ``--global_segment_size`` bytes to the store of the master at
    ``--master_server_address`` until SIGINT or SIGTERM, then unmounts and exits 0. Upstream's
    flags (gflags style: ``--flag=value``, ``-flag``, a bare ``--flag`` or ``--noflag`` for a
    boolean). Differs from upstream's: ``--host`` defaults to 127.0.0.1 and must be an address
    peers reach this process at (0.0.0.0 is refused; ``host:port`` fixes the engine's port).
    ``--port`` (0: any free port) serves dummy clients (``setup_dummy``, SGLang's
    ``standalone_storage`` mode) on the host of ``--host``: not upstream's proxy RPC service, but
    what a dummy needs to join the same store itself (the master, protocol, NICs and this
    segment), to processes that present the job secret. ``--start_offload_rpc_server``,
    ``--threads`` and ``--metadata_server`` are unused; SSD offload and other tenants are
    refused, and ``--enable_http_server`` is accepted with a warning (nothing listens), as
    ``setup()`` does."""
    ap = argparse.ArgumentParser(prog="mooncake_client", description=client_main.__doc__,
                                 allow_abbrev=False)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("--global_segment_size", default="4GB")
    ap.add_argument("--local_buffer_size", default="0")
    ap.add_argument("--master_server_address", default="127.0.0.1:50051")
    ap.add_argument("--metadata_server", default="P2PHANDSHAKE")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device_names", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tenant_id", default="default")
    for name, default in zip(_CLIENT_BOOLS, (False, True, False)):
        ap.add_argument("--" + name, type=_flag_bool, nargs="?", const=True, default=default)
    ap.add_argument("--http_port", type=int, default=9300)
    ap.add_argument("--version", action="store_true")
    args = ap.parse_args(_gflags_style(sys.argv[1:] if argv is None else list(argv)))
    if args.version:
        try:
            from importlib.metadata import version
            print(f"mooncake_client {version('mooncake')}")
        except Exception:  # noqa: BLE001  (not installed: a build tree)
            print("mooncake_client (build tree, not installed)")
        return 0
    from .store import MooncakeDistributedStore, parse_size
    try:
        segment = parse_size(args.global_segment_size)
        local = parse_size(args.local_buffer_size)
    except ValueError as e:
        ap.error(str(e))
    if segment <= 0:
        ap.error("--global_segment_size must be > 0 (this process exists to lend memory)")
    if _host_part(args.host) in ("0.0.0.0", "::", ""):
        ap.error(f"--host {args.host!r}: give the address other processes reach this one at "
                 "(it names the segment)")
    # SIGINT and SIGTERM are taken with sigwait below, in this thread only (a handler could
    # run while the main thread holds a lock it needs).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    st = MooncakeDistributedStore()
    rc = st.setup(args.host, args.metadata_server, segment, local, args.protocol,
                  args.device_names, args.master_server_address,
                  enable_ssd_offload=args.enable_offload, tenant_id=args.tenant_id,
                  enable_client_http_server=args.enable_http_server,
                  client_http_port=args.http_port)
    if rc != 0:
        print(f"mooncake_client: setup failed ({rc}); master {args.master_server_address}",
              file=sys.stderr)
        return 1
    try:
        port = st._c.serve_dummies(_host_part(args.host), args.port, {
            "master_server_addr": args.master_server_address, "protocol": args.protocol,
            "rdma_devices": args.device_names})
    except (RuntimeError, ValueError) as e:
        print(f"mooncake_client: {e} (--port=0 picks a free port)", file=sys.stderr)
        st.close()
        return 1
    print(f"mooncake_client ready segment={st.get_hostname()} bytes={segment} "
          f"master={args.master_server_address} port={port}", flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    st.close()
    return 0


if __name__ == "__main__":
    main()

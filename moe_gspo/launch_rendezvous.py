"""The launcher's checks of its rendezvous flags, before torchrun's agent starts (`moe_gspo.launch`).

torchrun's agent turned three mistakes into a traceback or a long silence (issue 59):
- a port out of range (`--master-port 99999`, `--rdzv-endpoint host:70000`) raised a ValueError traceback;
- `--rdzv-endpoint localhost:PORT` (c10d) with PORT held by another program: the agent, unable to host the
  store, joined whatever listened there as a client and waited in silence for 300 s;
- `--master-addr` (or a c10d endpoint) that nothing answers: up to 15 minutes of connection retries printed
  with C++ stack frames.

`check_rendezvous(args)` resolves the endpoint as torchrun does (`--standalone` and a single node without
`--master-port`: a free port of torchrun's choosing, nothing to check) and raises one ValueError:
- a port outside 0-65535, or an endpoint torch cannot parse;
- on the node that hosts the store (static: `--node-rank 0`; c10d: the endpoint names this machine, or
  `--rdzv-conf is_host=...`): a port already in use, when this launch is the only node (`--nnodes 1`; with more
  nodes on one machine another node's launcher may be the one listening there);
- on the other nodes: the endpoint's host does not resolve, or its port accepts no connection within
  `MASTER_WAIT_S` seconds (the host node's launcher starts first or within that time); torch's own
  `--rdzv-conf timeout=S` (static) or `join_timeout=S` (c10d) sets the wait instead.
"""

from __future__ import annotations

import argparse
import errno
import socket
import time

MASTER_WAIT_S = 120
"""Seconds a node that does not host the rendezvous waits for the host's port to accept a connection."""
DEFAULT_C10D_PORT = 29400
"""torch's default port of a c10d endpoint given without one."""


def _conf(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for item in str(getattr(args, "rdzv_conf", "") or "").split(","):
        key, eq, value = item.partition("=")
        if eq:
            out[key.strip()] = value.strip()
    return out


def _max_nodes(args: argparse.Namespace) -> int | None:
    try:
        from torch.distributed.run import parse_min_max_nnodes

        return parse_min_max_nnodes(args.nnodes)[1]
    except Exception:  # noqa: BLE001 - torchrun's own parser reports a malformed --nnodes
        return None


def endpoint(args: argparse.Namespace) -> tuple[str, str, int, bool] | None:
    """(backend, host, port, this node hosts the store) as torchrun's `run` will use them, or None when there is
    nothing to check (`--standalone`, a free port torchrun picks, another backend). ValueError for a bad port."""
    if args.standalone:
        return None
    backend = args.rdzv_backend
    if backend not in ("static", "c10d"):
        return None
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    if backend == "static" and not args.rdzv_endpoint:
        if args.master_port is None:
            if _max_nodes(args) == 1:  # torchrun switches to c10d on a free port
                return None
            port = 29500
        else:
            port = int(args.master_port)
        if not 0 <= port <= 65535:
            raise ValueError(f"--master-port {port} is not a port: give one in 1-65535, or --standalone to let the "
                             "launcher pick a free one")
        return "static", args.master_addr, port, int(args.node_rank) == 0
    try:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_C10D_PORT)
    except ValueError as e:
        why = str(e).strip().rstrip(".")
        raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: {why} (e.g. node0:29400)") from None
    if port == 0:
        return None
    if backend == "static":
        return "static", host, port, int(args.node_rank) == 0
    is_host = _conf(args).get("is_host")
    hosts = (is_host.lower() in ("1", "true", "yes", "y")) if is_host is not None else _matches_machine_hostname(host)
    return "c10d", host, port, hosts


def _port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's server: TIME_WAIT is no obstacle
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _flag(backend: str) -> str:
    return "--master-addr / --master-port, or --rdzv-endpoint" if backend == "static" else "--rdzv-endpoint"


def wait_for_host(backend: str, host: str, port: int, wait_s: float) -> None:
    """Return once `host:port` accepts a TCP connection; ValueError when `host` does not resolve or nothing
    accepts within `wait_s` seconds."""
    where = f"{host}:{port}"
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"the rendezvous host {host!r} ({_flag(backend)}) does not resolve ({e}); give the "
                         "host name or address of the node that hosts the rendezvous") from None
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        for family, kind, proto, _, addr in addrs:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                try:
                    s.connect(addr)
                    return
                except OSError as e:
                    last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            knob = "timeout" if backend == "static" else "join_timeout"
            raise ValueError(f"nothing accepted a connection at the rendezvous {where} ({_flag(backend)}) within "
                             f"{wait_s:g} s (last: {last}); start the launcher of the node that hosts it (node rank "
                             f"0) first, check the address and port, or wait longer with --rdzv-conf {knob}=SECONDS")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def check_rendezvous(args: argparse.Namespace) -> None:
    """One ValueError for a rendezvous flag that would fail in torchrun's agent (see the module docstring)."""
    resolved = endpoint(args)
    if resolved is None:
        return
    backend, host, port, hosts = resolved
    if hosts:
        if port and _max_nodes(args) == 1 and _port_busy(port):
            raise ValueError(f"port {port} is already in use on this machine (another torchrun or program listens "
                             "there), so the launcher cannot host the rendezvous; pass another --master-port (or "
                             "--rdzv-endpoint HOST:PORT), or --standalone to let it pick a free port")
        return
    conf = _conf(args)
    knob = "timeout" if backend == "static" else "join_timeout"
    try:
        wait = float(conf[knob]) if knob in conf else MASTER_WAIT_S
    except ValueError:
        raise ValueError(f"--rdzv-conf {knob}={conf[knob]} must be a number of seconds") from None
    wait_for_host(backend, host, port, wait)

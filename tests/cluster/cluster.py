"""A simulated cluster on one machine: N network namespaces with their own hostnames, bridged, shaped, torn down on exit.

Usage (as root)::

    python tests/cluster/cluster.py up 2             # prints the cluster directory; stays up
    python tests/cluster/cluster.py down [DIR]       # removes one cluster (or every one of ours)
    python tests/cluster/cluster.py run -n 4 --nodes 2 [--rate 1gbit] -- python -m hpcgrad.info

Node i is the network namespace ``hpcgrad-node<i>-<id>`` (``id`` unique per cluster, so parallel
runs don't collide) holding one end of a veth pair, ``hgc0`` (the same name in every node), with
address 10.213.<subnet>.<i>/24; the other end is enslaved to the bridge ``hgc<id>br`` in the root
namespace, which holds 10.213.<subnet>.254. ``--rate`` puts a ``tc tbf`` on each host-side veth,
shaping the traffic into that node (the kernel has tbf/htb, not netem: bandwidth, no delay).

Note [MPI across namespaces]
----------------------------
What works with the ``mpich`` wheel (MPICH 5.0, hydra, ch4 built with ucx and ofi):

- ``mpiexec -launcher ssh -launcher-exec tests/cluster/launcher.sh -hosts node1:2,node2:2``
  Nothing resolves node names in the root namespace, and hydra needs it not to: it takes an
  unknown name for a remote host and execs ``launcher.sh [-x] node<i> CMD...`` per proxy; the
  launcher maps the name (or an address) to its node through the cluster's ``hosts`` file
  (``$HPCGRAD_CLUSTER_HOSTS``) and runs CMD inside that namespace under a fresh UTS namespace
  whose hostname is ``node<i>``. Names rather than addresses, so that hydra's own messages
  name the node like on a real cluster ("BAD TERMINATION ... PID p RUNNING AT node2").
- ``-iface hgc<id>br``: the proxies connect back to mpiexec's control port; from inside a node only
  the bridge's address reaches the root namespace (its loopback is the node's own).
- The ranks' environment (see ``mpi_env``): see that function for the netmod settings and why.

Open MPI 5's ``mpirun`` (prterun, the ``ft`` extra in .venv-ft; see ``mpirun_argv``) uses the same
launcher, unchanged: ``--prtemca plm_ssh_agent tests/cluster/launcher.sh`` makes it exec
``launcher.sh node<i> "PRTE_PREFIX=...; prted ..."`` per node, with a hostfile naming the nodes
(``node<i> slots=R``). The HNP stays in the root namespace and runs no rank (its hostname is in
no hostfile); ``oob_tcp_if_include`` and ``btl_tcp_if_include`` with the cluster's subnet make the
daemons and the ranks talk over the bridge (the subnet, not an interface name: the bridge is
``hgc<id>br`` in the root namespace, ``hgc0`` inside a node). Each rank has its world rank in
its environment (``OMPI_COMM_WORLD_RANK``): a test can tell which ranks a namespace holds.
"""

import argparse
import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX = "hpcgrad-node"
NODE_IFACE = "hgc0"
SUBNET_BASE = "10.213"
STATE_ROOT = Path(tempfile.gettempdir()) / "hpcgrad-cluster"
LAUNCHER = Path(__file__).resolve().parent / "launcher.sh"
_MAX_NODES = 64


class ClusterError(RuntimeError):
    """A namespace, link or address could not be made (not root, no CAP_NET_ADMIN, a name in use)."""


def _ip(*args, check=True):
    proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}; "
                           "the simulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    return proc


def _used_subnets():
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    used = set()
    for word in out.split():
        if word.startswith(SUBNET_BASE + "."):
            used.add(int(word.split(".")[2]))
    return used


def namespaces():
    """Names of this project's node namespaces that exist now (any cluster's)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def can_make_namespaces():
    """(True, "") if this process can build a cluster here, else (False, why): for skip reasons."""
    if os.geteuid() != 0:
        return False, "the simulated cluster needs root (ip netns add)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return False, f"the simulated cluster needs `{tool}` on PATH"
    name = f"{PREFIX}-probe-{os.getpid()}"
    proc = _ip("netns", "add", name, check=False)
    if proc.returncode != 0:
        return False, f"`ip netns add` failed: {proc.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return True, ""


class Cluster:
    """N nodes joined by a bridge; `up()` builds, `down()` removes everything it built (idempotent)."""

    def __init__(self, nodes, rate=None, cluster_id=None):
        if not 1 <= nodes <= _MAX_NODES:
            raise ValueError(f"nodes must be in 1..{_MAX_NODES}, got {nodes}")
        self.nodes = nodes
        self.rate = rate
        self.id = cluster_id or secrets.token_hex(2)  # 4 hex digits: interface names stay < 16 chars
        self.bridge = f"hgc{self.id}br"
        self.directory = STATE_ROOT / self.id
        self.subnet = None
        self._built = []  # (kind, name) in build order; down() undoes them in reverse

    # --- names -------------------------------------------------------------------------------
    def netns(self, i):
        return f"{PREFIX}{i}-{self.id}"

    def hostname(self, i):
        return f"node{i}"

    def address(self, i):
        return f"{SUBNET_BASE}.{self.subnet}.{i}"

    @property
    def bridge_address(self):
        return f"{SUBNET_BASE}.{self.subnet}.254"

    @property
    def hosts_file(self):
        return self.directory / "hosts"

    # --- up / down ---------------------------------------------------------------------------
    def up(self):
        free = sorted(set(range(1, 255)) - _used_subnets())
        if not free:
            raise ClusterError(f"no free {SUBNET_BASE}.X.0/24 subnet for the cluster; run `cluster.py down`")
        self.subnet = free[0]
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        self._built.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.nodes + 1):
            ns, host_end = self.netns(i), f"hgc{self.id}n{i}"
            _ip("netns", "add", ns)
            self._built.append(("netns", ns))
            _ip("link", "add", host_end, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
            self._built.append(("link", host_end))
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", NODE_IFACE)
            _ip("-n", ns, "link", "set", NODE_IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                proc = subprocess.run(["tc", "qdisc", "add", "dev", host_end, "root", "tbf", "rate",
                                       self.rate, "burst", "256kb", "latency", "50ms"],
                                      check=False, capture_output=True, text=True, timeout=20)
                if proc.returncode != 0:
                    raise ClusterError(f"tc tbf rate {self.rate} on {host_end} failed: {proc.stderr.strip()}")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._built.append(("dir", str(self.directory)))
        self.hosts_file.write_text("".join(f"{self.address(i)} {self.hostname(i)} {self.netns(i)}\n"
                                           for i in range(1, self.nodes + 1)))
        (self.directory / "state.json").write_text(json.dumps(
            {"id": self.id, "nodes": self.nodes, "subnet": self.subnet, "bridge": self.bridge,
             "rate": self.rate, "built": self._built}))

    def down(self):
        for kind, name in reversed(self._built):
            if kind == "netns":
                _ip("netns", "del", name, check=False)  # takes the node's veth end (and its peer) with it
            elif kind == "link":
                _ip("link", "del", name, check=False)
            elif kind == "dir":
                shutil.rmtree(name, ignore_errors=True)
        self._built = []

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # --- MPI -----------------------------------------------------------------------------------
    def hosts_arg(self, ranks_per_node):
        return ",".join(f"{self.hostname(i)}:{ranks_per_node}" for i in range(1, self.nodes + 1))

    def mpi_env(self):
        """Environment for mpiexec and its ranks across the nodes (Note [MPI across namespaces])."""
        return {
            "HPCGRAD_CLUSTER_HOSTS": str(self.hosts_file),
            # The wheel's default netmod, ucx, sees one machine (same boot id) and moves inter-node
            # data through shared memory/CMA: ~16 KB crossed a link for a 16 MB all-reduce. ofi's
            # tcp provider sends it over the node's interface, like a real cluster.
            "MPIR_CVAR_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": NODE_IFACE,
        }

    @property
    def subnet_cidr(self):
        return f"{SUBNET_BASE}.{self.subnet}.0/24"

    def mpirun_env(self):
        """Environment for Open MPI's mpirun across the nodes: the launcher's hosts file only (the
        MPICH netmod settings of ``mpi_env`` mean nothing to it)."""
        return {"HPCGRAD_CLUSTER_HOSTS": str(self.hosts_file)}

    def mpirun_argv(self, nprocs, command, mpirun, options=()):
        """Open MPI 5's ``mpirun OPTIONS ... -n nprocs command`` over the nodes, ``nprocs / nodes``
        ranks each in rank order (node1 holds ranks 0..R-1), through launcher.sh (Note [MPI
        across namespaces]); writes the cluster's ``hostfile``."""
        if nprocs % self.nodes:
            raise ValueError(f"{nprocs} ranks do not divide evenly over {self.nodes} nodes; "
                             f"pass a multiple of {self.nodes}")
        hostfile = self.directory / "hostfile"
        hostfile.write_text("".join(f"{self.hostname(i)} slots={nprocs // self.nodes}\n"
                                    for i in range(1, self.nodes + 1)))
        return [mpirun, *options, "--prtemca", "plm_ssh_agent", str(LAUNCHER),
                "--prtemca", "oob_tcp_if_include", self.subnet_cidr,
                "--mca", "btl_tcp_if_include", self.subnet_cidr,
                "--hostfile", str(hostfile), "--map-by", "slot", "-n", str(nprocs), *command]

    def mpiexec_argv(self, nprocs, command, mpiexec=None):
        """`mpiexec ... -n nprocs command`, spreading nprocs ranks evenly over the nodes."""
        if nprocs % self.nodes:
            raise ValueError(f"{nprocs} ranks do not divide evenly over {self.nodes} nodes; "
                             f"pass a multiple of {self.nodes}")
        mpiexec = mpiexec or str(Path(sys.executable).parent / "mpiexec")
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(LAUNCHER), "-iface", self.bridge,
                "-hosts", self.hosts_arg(nprocs // self.nodes), "-n", str(nprocs), *command]


def down_all():
    """Remove every cluster of this project (namespaces, bridges, state directories)."""
    for ns in namespaces():
        _ip("netns", "del", ns, check=False)
    out = _ip("-o", "link", "show", check=False).stdout
    for line in out.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if re.fullmatch(r"hgc[0-9a-f]{4}(br|n\d+)", name):
            _ip("link", "del", name, check=False)
    shutil.rmtree(STATE_ROOT, ignore_errors=True)


def _kill_job(proc):
    """End mpiexec and the proxies it launched (one process group: its own session), bounded."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _down_on_signals(cluster, job):
    """On exit, SIGTERM, SIGHUP and SIGINT end the job (job[0]) and tear the cluster down; atexit alone misses signals."""
    def cleanup():
        _kill_job(job[0])
        cluster.down()

    atexit.register(cleanup)

    def handler(signum, frame):
        cleanup()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, handler)


def run(nprocs, nodes, command, rate=None, timeout=120):
    """Bring up `nodes` nodes, run `command` on `nprocs` ranks across them, tear down; the exit code."""
    cluster = Cluster(nodes, rate=rate)
    job = [None]
    _down_on_signals(cluster, job)
    try:
        cluster.up()
        env = {**os.environ, **cluster.mpi_env(), "MPIEXEC_TIMEOUT": str(timeout)}
        job[0] = subprocess.Popen(cluster.mpiexec_argv(nprocs, command), env=env, start_new_session=True)
        try:
            return job[0].wait(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            print(f"cluster.py: the job outlived MPIEXEC_TIMEOUT={timeout} by 10 s; killed", file=sys.stderr)
            return 124
    finally:
        _kill_job(job[0])
        cluster.down()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build a cluster and leave it up; prints its directory")
    up.add_argument("nodes", type=int)
    up.add_argument("--rate", help="tc tbf rate per node link, e.g. 1gbit")
    down = sub.add_parser("down", help="remove one cluster (its directory or id), or all of ours")
    down.add_argument("which", nargs="?")
    runp = sub.add_parser("run", help="up, run a command under mpiexec across the nodes, down")
    runp.add_argument("-n", type=int, required=True, help="ranks in all")
    runp.add_argument("--nodes", type=int, required=True)
    runp.add_argument("--rate")
    runp.add_argument("--timeout", type=int, default=120)
    runp.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.action == "up":
        cluster = Cluster(args.nodes, rate=args.rate).up()
        print(cluster.directory)
        print(f"HPCGRAD_CLUSTER_HOSTS={cluster.hosts_file}")
        print(" ".join(cluster.mpiexec_argv(args.nodes, ["CMD"])))
        return 0
    if args.action == "down":
        if args.which is None:
            down_all()
            return 0
        state = json.loads((STATE_ROOT / Path(args.which).name / "state.json").read_text())
        cluster = Cluster(state["nodes"], cluster_id=state["id"])
        cluster._built = [tuple(item) for item in state["built"]]
        cluster.down()
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command after --")
    return run(args.n, args.nodes, command, rate=args.rate, timeout=args.timeout)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

"""A two-node cluster on one machine, for the multi-node tests (tests/test_multinode.py).

Each node is a network namespace with its own hostname (a UTS namespace), its own /etc/hosts (a
mount namespace), its own share of the CPUs (taskset) and an sshd from Debian's openssh-server
listening on its address only. The nodes are joined by a veth pair on 10.233.X.0/24; nothing else
(apart from each node's loopback) is reachable from them. mpirun runs on node A and starts node B's
ranks through ssh, with keys, known_hosts and configs generated in a temporary directory:

    c = Cluster()            # Cluster.why_not() first: None, or why it cannot be built here
    c.start()                # raises ClusterError on failure; c.close() always cleans up
    c.run("a", ["mpirun", "-np", "4", "--hostfile", c.hostfile(2), ...], env=c.mpi_env(ENV))
    c.close()                # kills every process in both namespaces, deletes them (and the veths)

Names carry the creating process's id (ddpa<pid>, ddpb<pid>), so parallel runs do not clash, and
start() first removes what an earlier run that was killed left behind (its process is gone)."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
TOOLS = ("ip", "unshare", "nsenter", "taskset", "ssh", "ssh-keygen")
NODES = ("a", "b")


class ClusterError(RuntimeError):
    pass


def sh(args, check=True, **kw):
    """Runs a command; raises ClusterError with its output when it fails and check is set."""
    p = subprocess.run(args, capture_output=True, text=True, **kw)
    if check and p.returncode:
        raise ClusterError(f"{' '.join(args)} exited {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")
    return p


def netns_pids(ns):
    p = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def kill_netns(ns):
    """SIGKILL to every process in the namespace, until none is left (at most 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        pids = netns_pids(ns)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove_stale():
    """Deletes the namespaces and directories of earlier runs whose process is gone (a test killed mid-run)."""
    p = sh(["ip", "netns", "list"], check=False)
    for line in p.stdout.splitlines():
        m = re.match(r"(ddp[ab](\d+))\b", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            kill_netns(m.group(1))
            sh(["ip", "netns", "delete", m.group(1)], check=False)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "ddp_netns_*_*")):
        m = re.match(r"ddp_netns_(\d+)_", os.path.basename(d))
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(d, ignore_errors=True)


def cgroup_mounts():
    """Shell commands that mount this machine's cgroup hierarchies again under the fresh /sys that
    `ip netns exec` mounts (slurmd needs them), or ':' when there are none."""
    cmds = []
    with open("/proc/self/mounts") as f:
        for line in f:
            src, where, kind, opts = line.split()[:4]
            if where == "/sys/fs/cgroup" or where.startswith("/sys/fs/cgroup/"):
                cmds.append(f"mkdir -p {where} && mount -t {kind} -o {opts} {src} {where};")
    return " ".join(cmds) or ":"


class Cluster:
    def __init__(self):
        self.tag = os.getpid()
        self.ns = {n: f"ddp{n}{self.tag}" for n in NODES}  # also the name of the node's veth end
        self.net = f"10.233.{self.tag % 250 + 1}"
        self.subnet = f"{self.net}.0/24"
        self.addr = {"a": f"{self.net}.1", "b": f"{self.net}.2"}
        self.host = {n: f"ddpnode-{n}" for n in NODES}
        cpus = sorted(os.sched_getaffinity(0))
        half = max(1, len(cpus) // 2)
        self.cpus = {"a": cpus[:half], "b": cpus[half:]}  # each node's share of this machine's CPUs
        self.dir = None
        self.sshd = {}

    @staticmethod
    def why_not():
        """None when a cluster can be built here, else the reason."""
        if os.geteuid() != 0:
            return "needs root (network namespaces, sshd)"
        missing = [t for t in TOOLS if not shutil.which(t)]
        if missing:
            return "missing " + ", ".join(missing)
        if not os.access(SSHD, os.X_OK):
            return f"no {SSHD} (apt-get install openssh-server)"
        if len(os.sched_getaffinity(0)) < 2:
            return "needs 2 CPUs (one per node)"
        name = f"ddpprobe{os.getpid()}"
        p = sh(["ip", "netns", "add", name], check=False)
        sh(["ip", "netns", "delete", name], check=False)
        if p.returncode:
            return "cannot create a network namespace: " + p.stderr.strip()
        return None

    def start(self):
        remove_stale()
        for n in NODES:  # our own names left by an earlier process with our id
            if os.path.exists(f"/run/netns/{self.ns[n]}"):
                kill_netns(self.ns[n])
                sh(["ip", "netns", "delete", self.ns[n]], check=False)
        self.dir = tempfile.mkdtemp(prefix=f"ddp_netns_{self.tag}_")
        os.mkdir(self.file("tmp"))
        for n in NODES:
            sh(["ip", "netns", "add", self.ns[n]])
        a, b = self.ns["a"], self.ns["b"]
        sh(["ip", "link", "add", a, "netns", a, "type", "veth", "peer", "name", b, "netns", b])
        for n in NODES:
            sh(["ip", "-n", self.ns[n], "addr", "add", f"{self.addr[n]}/24", "dev", self.ns[n]])
            sh(["ip", "-n", self.ns[n], "link", "set", "lo", "up"])
            sh(["ip", "-n", self.ns[n], "link", "set", self.ns[n], "up"])
        self._keys()
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for n in NODES:
            self.start_node(n)

    def file(self, name):
        return os.path.join(self.dir, name)

    def _keys(self):
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddp-test-user", "-f", self.file("id_ed25519")])
        shutil.copy(self.file("id_ed25519.pub"), self.file("authorized_keys"))
        known = []
        for n in NODES:
            key = self.file(f"host_{n}")
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.host[n], "-f", key])
            with open(key + ".pub") as f:
                known.append(f"{self.host[n]},{self.addr[n]} {' '.join(f.read().split()[:2])}\n")
        with open(self.file("known_hosts"), "w") as f:
            f.writelines(known)
        with open(self.file("hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{self.addr[n]} {self.host[n]}\n" for n in NODES))
        with open(self.file("ssh_config"), "w") as f:
            f.write(f"""Host *
  User root
  IdentityFile {self.file("id_ed25519")}
  IdentitiesOnly yes
  UserKnownHostsFile {self.file("known_hosts")}
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
""")
        for n in NODES:
            with open(self.file(f"sshd_{n}.conf"), "w") as f:
                f.write(f"""Port 22
ListenAddress {self.addr[n]}
HostKey {self.file(f"host_{n}")}
AuthorizedKeysFile {self.file("authorized_keys")}
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {self.file(f"sshd_{n}.pid")}
""")

    def start_node(self, n):
        """(Re)starts node n: its link up, a fresh hostname and mount namespace, and its sshd pinned to
        the node's CPUs (every process ssh starts there inherits them)."""
        sh(["ip", "-n", self.ns[n], "link", "set", self.ns[n], "up"])
        pidfile = self.file(f"sshd_{n}.pid")
        if os.path.exists(pidfile):
            os.unlink(pidfile)
        cpus = ",".join(map(str, self.cpus[n]))
        script = (f"hostname {self.host[n]} && mount --bind {self.file('hosts')} /etc/hosts && "
                  f"{{ {cgroup_mounts()} }}; exec taskset -c {cpus} {SSHD} -D -e -f {self.file(f'sshd_{n}.conf')}")
        log = open(self.file(f"sshd_{n}.log"), "ab")
        self.sshd[n] = subprocess.Popen(["ip", "netns", "exec", self.ns[n], "unshare", "--uts", "--mount", "sh", "-c",
                                         script], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 10
        while not os.path.exists(pidfile):  # sshd writes it once it listens
            if self.sshd[n].poll() is not None or time.monotonic() > deadline:
                with open(self.file(f"sshd_{n}.log")) as f:
                    raise ClusterError(f"sshd on node {n} did not start: {f.read()[-400:]}")
            time.sleep(0.02)

    def node_pid(self, n):
        """A process inside node n (its sshd), whose namespaces nsenter joins."""
        with open(self.file(f"sshd_{n}.pid")) as f:
            return int(f.read())

    def command(self, n, args, cwd=None):
        """args as run on node n, in cwd (else /), under the node's CPUs."""
        cpus = ",".join(map(str, self.cpus[n]))
        return (["nsenter", "-t", str(self.node_pid(n)), "-n", "-u", "-m", f"--wd={cwd or '/'}", "--", "taskset", "-c",
                 cpus] + list(args))

    def run(self, n, args, env=None, timeout=120, cwd=None):
        p = subprocess.run(self.command(n, args, cwd), capture_output=True, text=True, env=env, timeout=timeout)
        return p.returncode, p.stdout, p.stderr

    def popen(self, n, args, env=None, cwd=None):
        return subprocess.Popen(self.command(n, args, cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    def hostfile(self, slots):
        path = self.file(f"hostfile_{slots}")
        with open(path, "w") as f:
            f.write("".join(f"{self.host[n]} slots={slots}\n" for n in NODES))
        return path

    def mpi_env(self, base):
        """base plus what mpirun on node A needs: ssh as the launcher, and the test network named for
        Open MPI's TCP transport (btl) and its runtime's connections (oob). A short TCP keepalive on
        the runtime's connections finds a node that vanished from the network in about 5 s."""
        env = {k: v for k, v in base.items() if k != "OMPI_MCA_rmaps_base_oversubscribe"}
        env.update(OMPI_MCA_plm_rsh_agent=f"ssh -F {self.file('ssh_config')}",
                   OMPI_MCA_btl_tcp_if_include=self.subnet, OMPI_MCA_oob_tcp_if_include=self.subnet,
                   OMPI_MCA_oob_tcp_keepalive_time="2", OMPI_MCA_oob_tcp_keepalive_intvl="1",
                   OMPI_MCA_oob_tcp_keepalive_probes="3",
                   # session directories and shared-memory files here, so a killed node leaves nothing behind
                   OMPI_MCA_orte_tmpdir_base=self.file("tmp"), OMPI_MCA_btl_vader_backing_directory=self.file("tmp"))
        return env

    def link_bytes(self, n):
        """(received, sent) bytes of node n's end of the veth."""
        p = sh(["ip", "-n", self.ns[n], "-s", "-j", "link", "show", "dev", self.ns[n]])
        stats = json.loads(p.stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def kill_node(self, n):
        """Node n dies: SIGKILL to every process in its namespace (sshd, orted, ranks)."""
        kill_netns(self.ns[n])

    def cut_link(self, n):
        sh(["ip", "-n", self.ns[n], "link", "set", self.ns[n], "down"])

    def revive(self, n):
        """After kill_node or cut_link: node n's leftovers killed, its link up and its sshd back."""
        kill_netns(self.ns[n])
        if n in self.sshd:
            self.sshd[n].wait()
        self.start_node(n)

    def close(self):
        for n in NODES:
            kill_netns(self.ns[n])
            if n in self.sshd:
                try:
                    self.sshd[n].wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            sh(["ip", "netns", "delete", self.ns[n]], check=False)  # the veth goes with it
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

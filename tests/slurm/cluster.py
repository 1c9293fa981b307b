"""A real single-node SLURM cluster for tests: munge + slurmctld + slurmd from Debian packages, one fake GPU.

Everything lives in one folder (config, state, spool, logs, the munge key and socket, the fake GPU device), on
free ports, with its own munge socket: it does not touch /etc/slurm, /etc/munge or a SLURM already running on
the machine, and two clusters (two test sessions) can run side by side. Clients reach it through the
environment in :attr:`Cluster.env` (``SLURM_CONF``).

No slurmdbd: ``sacct`` fails on this cluster, so the SLURM executor must query job status with ``squeue``
(``slurm-status-command: squeue``), which MinJobAge (3600 s here: the tests read every job of a pipeline run
after it ended) keeps reliable.

Each daemon runs in the foreground under ``timeout -k`` (so a test session killed hard cannot leave it
running past ``lifetime_s``) and is stopped by the PID this module started, never by name.

Command line (stdlib only, so CI can call it with the system python3 before the venv exists)::

    python3 tests/slurm/cluster.py install      # apt-get the Debian packages if missing (root)
    python3 tests/slurm/cluster.py up DIR       # start a cluster in DIR; prints `export SLURM_CONF=... PATH=...`
    python3 tests/slurm/cluster.py down DIR     # stop the daemons started by `up DIR` (PIDs in DIR/pids.json)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")


class ClusterError(RuntimeError):
    """The cluster could not be installed, started or stopped."""


def which(binary: str) -> str | None:
    path = shutil.which(binary)
    if path:
        return path
    for directory in SBIN_DIRS:  # daemons live in sbin, which a non-root PATH may lack
        candidate = Path(directory) / binary
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def missing_binaries() -> list[str]:
    return [binary for binary in BINARIES if which(binary) is None]


def ensure_installed(log=print, timeout_s: int = 900) -> None:
    """Install munge and SLURM from Debian packages when missing. Raises ClusterError when that is impossible.

    Never a silent skip: without root or apt-get the error says what to install.
    """
    missing = missing_binaries()
    if not missing:
        return
    command = "apt-get install -y --no-install-recommends " + " ".join(PACKAGES)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterError(f"SLURM test cluster: {', '.join(missing)} not installed, and this is not a root "
                           f"Debian machine that could install them. Run as root: apt-get update && {command}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]  # another session may be installing at the same time
    log(f"[slurm-cluster] installing {' '.join(PACKAGES)} (missing: {', '.join(missing)})")
    for args in (["apt-get", *lock, "update", "-q"],
                 ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(["timeout", "-k", "10", str(timeout_s), *args], env=env, capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise ClusterError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                               f"{result.stderr[-3000:]}")
    still_missing = missing_binaries()
    if still_missing:
        raise ClusterError(f"after installing {PACKAGES}, still missing: {still_missing}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:  # a zombie (exited, not yet reaped) is not running
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


class Cluster:
    """One SLURM controller + one node with ``cpus`` CPUs, ``memory_mb`` MB and one fake GPU (gres ``gpu:1``)."""

    def __init__(self, root: str | Path, partition: str = "clemprm", cpus: int | None = None,
                 memory_mb: int = 4000, min_job_age_s: int = 3600, lifetime_s: int = 3600):
        self.root = Path(root).resolve()
        self.partition = partition
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.min_job_age_s = min_job_age_s
        self.lifetime_s = lifetime_s
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.pids_file = self.root / "pids.json"
        self._procs: dict[str, subprocess.Popen] = {}

    # --- environment and commands ---

    @property
    def env(self) -> dict:
        """Environment for SLURM clients (sbatch, squeue, the snakemake that calls them, and its jobs).

        PATH starts with ``root/bin``, whose ``srun`` sets SLURM_CONF before running the real one: the SLURM
        jobstep plugin (snakemake-executor-plugin-slurm-jobstep 0.6.1) removes every SLURM_* variable before its
        ``srun`` inside the job, so on a cluster found only through $SLURM_CONF that srun fails with
        "Could not establish a configuration source".
        """
        path = [str(self.root / "bin"), *os.environ.get("PATH", "").split(":")]
        path += [d for d in SBIN_DIRS if d not in path]
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": ":".join(p for p in path if p)}

    def run(self, *args: str, check: bool = True, timeout_s: int = 30) -> subprocess.CompletedProcess:
        result = subprocess.run(["timeout", "-k", "5", str(timeout_s), *args], env=self.env, capture_output=True,
                                text=True)
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job -d`` as a dict (keys like JobState, Comment, TresPerJob, JOB_GRES)."""
        text = self.run("scontrol", "show", "job", "-d", str(job_id)).stdout
        info: dict[str, str] = {"_text": text}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep and key not in info:
                info[key] = value
        return info

    def jobs(self) -> list[tuple[str, str]]:
        """(job id, state) of every job the controller still knows (finished ones for MinJobAge)."""
        out = self.run("squeue", "--states=all", "--noheader", "--format=%i|%T").stdout
        return [tuple(line.split("|", 1)) for line in out.splitlines() if "|" in line]

    # --- start ---

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        gpu = self.root / "dev" / "nvidia0"
        if not gpu.exists():
            # SLURM drops a GPU without a device file; a char device with /dev/null's numbers stands in for one.
            try:
                os.mknod(gpu, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            except PermissionError as error:
                raise ClusterError(f"mknod {gpu} (the fake GPU) needs root: {error}") from error
        ctld_port, slurmd_port = free_port(), free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        root = self.root
        self.conf.write_text(f"""\
# single-node test cluster written by tests/slurm/cluster.py
ClusterName=clemprm
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge={self.min_job_age_s}
KillWait=5
DefMemPerCPU=500
EnforcePartLimits=ALL
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} Gres=gpu:1 State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        (self.root / "gres.conf").write_text(f"NodeName={self.node} Name=gpu File={gpu}\n")
        srun = self.root / "bin" / "srun"
        srun.parent.mkdir(exist_ok=True)
        srun.write_text(f"#!/bin/sh\n# srun for this test cluster (see Cluster.env)\n"
                        f"SLURM_CONF='{self.conf}' exec '{which('srun')}' \"$@\"\n")
        srun.chmod(0o755)

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        # timeout -k: the daemon dies by itself after lifetime_s even if this process is killed before stop().
        proc = subprocess.Popen(["timeout", "-k", "10", str(self.lifetime_s), *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)
        log.close()
        self._procs[name] = proc
        self._save_pids()

    def _daemon_pid(self, name: str) -> int | None:
        """The daemon's own PID: the child of our `timeout` process."""
        proc = self._procs.get(name)
        if proc is None:
            return None
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def _save_pids(self) -> None:
        pids = {name: {"timeout": proc.pid, "daemon": self._daemon_pid(name)} for name, proc in self._procs.items()}
        self.pids_file.write_text(json.dumps(pids, indent=1))

    def _wait_for(self, what: str, ready, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout_s} s waiting for {what}:\n{self.logs()}")

    def start(self, timeout_s: float = 60) -> "Cluster":
        missing = missing_binaries()
        if missing:
            raise ClusterError(f"missing {missing}: call ensure_installed() first")
        self._write_config()
        socket_path = self.root / "munge" / "munge.socket"
        try:
            self._spawn("munged", which("munged"), "--foreground", "--force", f"--socket={socket_path}",
                        f"--key-file={self.root / 'munge' / 'munge.key'}",
                        f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                        f"--log-file={self.root / 'log' / 'munged.log'}",
                        f"--seed-file={self.root / 'munge' / 'munged.seed'}")
            self._wait_for("the munge socket", socket_path.exists, timeout_s)
            self._spawn("slurmctld", which("slurmctld"), "-D", "-c", "-f", str(self.conf))
            self._spawn("slurmd", which("slurmd"), "-D", "-N", self.node, "-f", str(self.conf))

            def node_idle():
                result = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False, timeout_s=10)
                return result.returncode == 0 and result.stdout.strip().startswith("idle")

            self._wait_for("the node to be idle", node_idle, timeout_s)
            self._save_pids()
        except BaseException:
            self.stop()
            raise
        return self

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-tail:]
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    # --- stop ---

    def cancel_all_jobs(self, timeout_s: float = 30) -> None:
        """scancel every job of this cluster and wait until none is pending, running or completing."""
        if not self._procs or any(p.poll() is not None for n, p in self._procs.items() if n == "slurmctld"):
            return
        active = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED", "RESIZING")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                live = [job for job, state in self.jobs() if state in active]
            except ClusterError:
                return
            if not live:
                return
            self.run("scancel", *live, check=False)
            time.sleep(1)

    def _job_processes(self) -> list[int]:
        """Processes still carrying this cluster's SLURM_CONF (job payloads left by a hard stop)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        own = {os.getpid()}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in own:
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ:
                found.append(int(entry.name))
        return found

    def stop(self, timeout_s: float = 15) -> None:
        """Cancel the jobs, then stop slurmd, slurmctld and munged: SIGTERM to the PIDs started here, SIGKILL
        after ``timeout_s``. Idempotent."""
        self.cancel_all_jobs()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            daemon = self._daemon_pid(name)
            proc.send_signal(signal.SIGTERM)  # timeout forwards it to the daemon, then SIGKILLs after -k
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if daemon and _ppid(daemon) in (proc.pid, 1) and str(self.root) in _cmdline(daemon) \
                    and not _wait_gone(daemon, 5):
                os.kill(daemon, signal.SIGKILL)
        for pid in self._job_processes():  # only processes started under this cluster's config
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs.clear()

    @classmethod
    def stop_from_pid_file(cls, root: str | Path, timeout_s: float = 15) -> None:
        """Stop the daemons recorded by `up` in another process (by PID, checking each is ours)."""
        root = Path(root).resolve()
        pids = json.loads((root / "pids.json").read_text())
        cluster = cls(root)
        try:
            cluster.run("scancel", "--user", str(os.getuid()), check=False)
        except ClusterError:
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            entry = pids.get(name) or {}
            for pid in (entry.get("timeout"), entry.get("daemon")):
                if pid and _alive(pid) and str(root) in _cmdline(pid):
                    os.kill(pid, signal.SIGTERM)
                    if not _wait_gone(pid, timeout_s):
                        os.kill(pid, signal.SIGKILL)
                    break
        for pid in cluster._job_processes():
            os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "install":
        ensure_installed()
        print("munge and SLURM are installed")
        return 0
    if len(argv) == 2 and argv[0] == "up":
        ensure_installed()
        cluster = Cluster(argv[1])
        cluster.start()
        for proc in cluster._procs.values():  # leave them running: `down` stops them by PID
            proc.returncode = 0
        print(f"export SLURM_CONF={cluster.conf} PATH={cluster.root / 'bin'}:$PATH")
        return 0
    if len(argv) == 2 and argv[0] == "down":
        Cluster.stop_from_pid_file(argv[1])
        return 0
    print(__doc__.split("Command line", 1)[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

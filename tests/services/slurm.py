"""A private one-node Slurm cluster for tests: munged, slurmctld and slurmd from Debian's
packages, run in a network namespace of their own with a generated slurm.conf, private munge
key and socket in a fresh temp folder, and removed when stopped."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from tests.services.base import PrivateServer

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
NAMESPACE_TOOLS = ("unshare", "nsenter", "ip")
# Slurm's clients find the controller through slurm.conf, so its port must be known before it
# starts: Slurm cannot listen on port 0 and report the port it got. Instead the daemons run in
# a network namespace of their own, where these ports are free by construction; no port of the
# machine is used, and clusters started side by side never meet.
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
NODE_NAME = "pinvault1"
PARTITION = "debug"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
# Slurm resolves even "127.0.0.1" with AI_ADDRCONFIG, which fails when loopback is the only
# interface with an IPv4 address; a veth pair with a documentation-range address (RFC 5737)
# gives the namespace one, and it reaches nothing outside.
_NAMESPACE_SETUP = """\
link set lo up
link add pv0 type veth peer name pv1
addr add 192.0.2.1/32 dev pv0
link set pv0 up
link set pv1 up
"""
# munged and sockaddr_un: sun_path holds 108 bytes.
_SOCKET_DIR_LIMIT = 80
FINISHED_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
_INSTALL_HINT = "run scripts/test, which installs Debian's slurmctld, slurmd, slurm-client, munge"


class SlurmUnavailable(RuntimeError):
    """Slurm, munge or the namespace tools are not installed, or we are not root."""


class SlurmClusterError(RuntimeError):
    """A daemon failed to start or the cluster did not come up; the message carries its logs."""


@dataclass(frozen=True)
class Submitted:
    """What a user sees from one `sbatch`: its exit status and output, and the job id."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def job_id(self) -> int:
        assert self.returncode == 0, self.describe()
        # --parsable prints "id" or "id;cluster".
        return int(self.stdout.strip().split(";")[0])

    def describe(self) -> str:
        return (
            f"sbatch exited {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )


class SlurmCluster(PrivateServer):
    """One controller and one node. `start()` (or `with`) runs them; `command()` wraps a client
    command so that it runs against this cluster; `sbatch`, `job`, `wait` and `output` are the
    steps a test takes; `stop()` kills every process of the cluster and deletes its folder.

    `job_submit` is a job_submit.lua to load (JobSubmitPlugins=lua), and `files` more files to
    write next to slurm.conf (where the lua plugin looks for its own configuration), as
    name → text.
    """

    name = "Slurm"

    def __init__(
        self,
        *,
        job_submit: Path | None = None,
        files: Mapping[str, str] | None = None,
        timeout: float = START_TIMEOUT,
    ) -> None:
        self.job_submit = job_submit
        self.files = dict(files or {})
        self._timeout = timeout
        self._base: Path | None = None
        self._holder: subprocess.Popen[bytes] | None = None
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"Slurm cluster already started in {self._base}")
        _check_installed()
        base = Path(tempfile.mkdtemp(prefix="pinvault-slurm-", dir=_temp_root()))
        self._base = base
        try:
            for folder in (self.conf_dir, self.state_dir, self.spool_dir, self.log_dir):
                folder.mkdir(mode=0o700)
            self.jobs_dir.mkdir(mode=0o755)
            self._write_munge_key()
            self._write_conf()
            self._start_namespace()
            self._spawn(
                "munged",
                "munged",
                "--foreground",
                # munged refuses root unless forced; the test cluster runs everything as root.
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={self.munge_key}",
                f"--pid-file={self.base_dir / 'munged.pid'}",
                f"--seed-file={self.base_dir / 'munged.seed'}",
                f"--log-file={self.log_dir / 'munged.log'}",
            )
            self._wait_for(lambda: self.munge_socket.exists(), "munged to create its socket")
            self._spawn("slurmctld", "slurmctld", "-D", "-f", str(self.conf_path))
            self._spawn("slurmd", "slurmd", "-D", "-N", NODE_NAME, "-f", str(self.conf_path))
            self._wait_for(self._node_idle, f"node {NODE_NAME} to be idle")
        except BaseException:
            self._kill_all()
            shutil.rmtree(base, ignore_errors=True)
            self._base = None
            raise
        atexit.register(self.stop)
        return self

    def _shut_down(self) -> None:
        """Stop the daemons and every job."""
        self._kill_all()

    # -- where things are -------------------------------------------------------------------

    @property
    def conf_dir(self) -> Path:
        return self.base_dir / "etc"

    @property
    def conf_path(self) -> Path:
        return self.conf_dir / "slurm.conf"

    @property
    def state_dir(self) -> Path:
        return self.base_dir / "state"

    @property
    def spool_dir(self) -> Path:
        return self.base_dir / "spool"

    @property
    def log_dir(self) -> Path:
        return self.base_dir / "log"

    @property
    def jobs_dir(self) -> Path:
        """Where `sbatch` puts each job's output, as <id>.out."""
        return self.base_dir / "jobs"

    @property
    def munge_socket(self) -> Path:
        return self.base_dir / "munge.socket"

    @property
    def munge_key(self) -> Path:
        return self.base_dir / "munge.key"

    # -- using it ---------------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a client command: the caller's, SLURM_CONF naming this cluster,
        and no other SLURM_ or SBATCH_ variable (they would change what sbatch does)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["SLURM_CONF"] = str(self.conf_path)
        env.update(extra or {})
        return env

    def command(self, *args: str) -> list[str]:
        """`args` as a command line that runs inside the cluster's network namespace, where
        its controller is reachable (with env() as its environment)."""
        return ["nsenter", f"--net={self._namespace}", "--", *args]

    def run(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (`scontrol`, `squeue`…) against this cluster."""
        return subprocess.run(
            self.command(*args),
            env=self.env(env),
            cwd=self.jobs_dir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def sbatch(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, *, script: str = ""
    ) -> Submitted:
        """`sbatch --parsable ARGS…` with `env` added to the environment it exports to the job,
        and `script` (if any) as the batch script on standard input. The job's output goes to
        jobs_dir/<id>.out unless `args` say otherwise."""
        defaults = [f"--output={self.jobs_dir}/%j.out", f"--chdir={self.jobs_dir}"]
        result = subprocess.run(
            self.command("sbatch", "--parsable", *defaults, *args),
            env=self.env(env),
            cwd=self.jobs_dir,
            input=script,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return Submitted(result.returncode, result.stdout, result.stderr)

    def job(self, job_id: int) -> dict[str, Any]:
        """The controller's record of a job, as `squeue --json` gives it (scontrol has no JSON
        output in 22.05, and its text output does not quote values that hold spaces)."""
        result = self.run("squeue", "--json", "--states=all")
        if result.returncode != 0:
            raise SlurmClusterError(f"squeue --json: {result.stderr.strip()}")
        # squeue 22.05 applies none of its filters to --json output.
        for job in json.loads(result.stdout)["jobs"]:
            if job["job_id"] == job_id:
                record: dict[str, Any] = job
                return record
        raise SlurmClusterError(f"squeue does not know job {job_id}")

    def wait(self, job_id: int, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for a job to finish; returns its record (see `job`)."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            if record["job_state"] in FINISHED_STATES:
                return record
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"job {job_id} still {record['job_state']} after {timeout}s\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def output(self, job_id: int) -> str:
        """What the job wrote to its standard output (the default --output of `sbatch`)."""
        return (self.jobs_dir / f"{job_id}.out").read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for daemon in DAEMONS:
            try:
                text = (self.log_dir / f"{daemon}.log").read_text(errors="replace")
            except OSError:
                continue
            parts.append(f"--- {daemon}.log ends:\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    # -- internals --------------------------------------------------------------------------

    @property
    def _namespace(self) -> str:
        if self._holder is None:
            raise RuntimeError("Slurm cluster is not running: call start() first")
        return f"/proc/{self._holder.pid}/ns/net"

    def _write_munge_key(self) -> None:
        # munged refuses a key readable by others; 1 KiB of random bytes as mungekey makes.
        fd = os.open(self.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as key:
            key.write(secrets.token_bytes(1024))

    def _write_conf(self) -> None:
        for name, text in self.files.items():
            (self.conf_dir / name).write_text(text)
        # An empty plugin stack of our own: the default /etc/slurm/plugstack.conf may hold a
        # site's SPANK plugins, and /dev/null lives in a world-writable folder Slurm warns of.
        (self.conf_dir / "plugstack.conf").write_text("")
        lines = [
            "ClusterName=pinvault-test",
            # slurmctld runs as primary only on the host SlurmctldHost names.
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={SLURMCTLD_PORT}",
            f"SlurmdPort={SLURMD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.state_dir}",
            f"SlurmdSpoolDir={self.spool_dir}",
            f"SlurmctldPidFile={self.base_dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.base_dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={self.conf_dir / 'plugstack.conf'}",
            "MailProg=/bin/true",
            # No cgroups here (nor in many CI containers): track processes by parentage.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            # Finished jobs stay visible to `scontrol show job` for the whole test run.
            "MinJobAge=3600",
            "KillWait=2",
        ]
        if self.job_submit is not None:
            # Slurm reads job_submit.lua from the folder slurm.conf is in.
            shutil.copyfile(self.job_submit, self.conf_dir / "job_submit.lua")
            lines.append("JobSubmitPlugins=lua")
        cpus = os.cpu_count() or 1
        lines += [
            f"NodeName={NODE_NAME} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE_NAME} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _start_namespace(self) -> None:
        # The holder keeps the namespace alive and names it (/proc/PID/ns/net) for nsenter.
        with open(self.log_dir / "unshare.out", "wb") as out:
            self._holder = holder = subprocess.Popen(
                ["unshare", "--net", "--", "sleep", "infinity"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        own = os.readlink("/proc/self/ns/net")

        def entered() -> bool:
            if holder.poll() is not None:
                raise SlurmClusterError(
                    f"unshare --net exited with {holder.returncode}, so the cluster has no "
                    f"network namespace:\n{self._output_of('unshare')}"
                )
            return _namespace_of(holder.pid) not in (None, own)

        self._wait_for(entered, "the network namespace")
        setup = subprocess.run(
            self.command("ip", "-batch", "-"),
            input=_NAMESPACE_SETUP,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if setup.returncode != 0:
            raise SlurmClusterError(f"setting up the network namespace failed: {setup.stderr}")

    def _spawn(self, name: str, *args: str) -> None:
        with open(self.log_dir / f"{name}.out", "wb") as out:
            self._daemons[name] = subprocess.Popen(
                self.command(*args),
                env=self.env(),
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def _node_idle(self) -> bool:
        for name, process in self._daemons.items():
            if process.poll() is not None:
                raise SlurmClusterError(
                    f"{name} exited with {process.returncode} while starting:\n"
                    f"{self._output_of(name)}\n{self.log_tail()}"
                )
        result = self.run("sinfo", "--noheader", "--node", NODE_NAME, "--format=%T", timeout=10)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _output_of(self, name: str) -> str:
        try:
            return (self.log_dir / f"{name}.out").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self._timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"timed out after {self._timeout}s waiting for {what}\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _kill_all(self) -> None:
        """SIGTERM the daemons, then SIGKILL whatever still runs in the namespace (job steps
        that slurmd left behind), then the namespace's holder."""
        for process in reversed(list(self._daemons.values())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in self._daemons.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._daemons.clear()
        holder, self._holder = self._holder, None
        if holder is None:
            return
        namespace = _namespace_of(holder.pid)
        if namespace is not None and namespace != os.readlink("/proc/self/ns/net"):
            for pid in _pids_in_namespace(namespace):
                if pid != holder.pid:
                    _kill(pid)
        holder.kill()
        holder.wait()


def _namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _pids_in_namespace(namespace: str) -> list[int]:
    """Every process whose network namespace is `namespace`: only this cluster's processes
    live there, since the namespace is the cluster's own."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _namespace_of(int(entry)) == namespace:
            pids.append(int(entry))
    return pids


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _check_installed() -> None:
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            "the test Slurm cluster runs its daemons as root in a network namespace of their "
            "own; run the tests as root"
        )
    missing = [p for p in (*DAEMONS, *CLIENTS, *NAMESPACE_TOOLS) if shutil.which(p) is None]
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)}; {_INSTALL_HINT}")


def _temp_root() -> str:
    """A temp folder short enough for the munge socket's path."""
    root = tempfile.gettempdir()
    if len(root) > _SOCKET_DIR_LIMIT - len("/pinvault-slurm-xxxxxxxx/munge.socket"):
        return "/tmp"
    return root

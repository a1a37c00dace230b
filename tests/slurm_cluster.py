"""A one-node SLURM on this machine, for the tests that submit what `shardkit launch` writes (tests/test_slurm.py).

munged with a fresh key, slurmctld and slurmd, all run as the current user (root in CI) from a temporary directory
that holds the key, slurm.conf, gres.conf, state, spool, pid and log files: nothing under /etc or /var is read or
written, and free TCP ports are taken for slurmctld/slurmd, so it can run beside a real SLURM or another copy of itself.
The node is this host with --cpus CPUs and --gpus GPU "cards" declared as a count-only GRES (no device files): a job
that asks for `--gpus-per-node` is scheduled as on a GPU cluster while the trainer itself sees no CUDA and runs gloo.
`scripts/install_slurm.sh` installs the Debian packages (slurm-wlm, munge) where apt can; `missing()` says why this
cluster cannot start here, for the tests' skip reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "srun", "sacct")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).is_file()),
                                      None)


def missing() -> str | None:
    """None where a cluster can be started here, else why not (the skip reason)."""
    absent = [n for n in DAEMONS + CLIENTS[:5] + ("mungekey",) if _which(n) is None]
    if absent:
        how = ("run scripts/install_slurm.sh (apt-get install slurm-wlm munge)" if shutil.which("apt-get")
               else "no apt-get on this machine to install slurm-wlm and munge")
        return f"SLURM not installed ({', '.join(absent)} missing): {how}"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 2, gpus: int = 2, kill_wait: int = 2) -> None:
        self.root = Path(root)
        self.cpus, self.gpus, self.kill_wait = cpus, gpus, kill_wait
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.start_seconds = 0.0

    # -- environment for the client commands (sbatch, squeue, ...) --------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf), **extra)
        for k in list(env):  # a test run inside a real SLURM job must not leak that job into this cluster
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del env[k]
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), env=self.env(**extra), capture_output=True, text=True, timeout=timeout)
        if check and p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
        return p

    # -- bring-up ---------------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        ctld_port, slurmd_port = _free_ports(2)
        user = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        self.socket = r / "munge" / "munge.socket.2"
        self.conf.write_text(f"""\
ClusterName=shardkit-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}
SlurmdPidFile={r / 'run' / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
KillWait={self.kill_wait}
MinJobAge=4
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        # count-only "cards": SLURM wants a device file per GPU; links to /dev/null stand in (no cgroup constrains them)
        for i in range(self.gpus):
            if not (r / "run" / f"gpu{i}").is_symlink():
                (r / "run" / f"gpu{i}").symlink_to("/dev/null")
        (r / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={r / 'run'}/gpu[0-{self.gpus - 1}]\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _wait(self, what: str, ok, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode} while waiting for {what}: {self.log_tail(name)}")
            if ok():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}: {self.log_tail()}")

    def log_tail(self, name: str | None = None, lines: int = 15) -> str:
        out = []
        for n in [name] if name else DAEMONS:
            for f in sorted((self.root / "log").glob(f"{n}*")):
                text = f.read_text(errors="replace").strip().splitlines()[-lines:]
                out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def start(self) -> "SlurmCluster":
        t0 = time.monotonic()
        self._write_config()
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key), "--force"], check=True,
                       capture_output=True)
        key.chmod(0o600)
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={self.socket}",
                               f"--key-file={key}", f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--pid-file={self.root / 'run' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait("munged's socket", self.socket.exists)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
        self._wait("the node to be idle", lambda: "idle" in self.run(
            "sinfo", "-h", "-N", "-o", "%T", check=False).stdout)
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        if self.procs:
            self.run("scancel", "--user", os.environ.get("USER", "root"), check=False)
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs.clear()

    # -- jobs -------------------------------------------------------------------------------------------------------
    def sbatch(self, script: str | Path, *opts: str, wait: bool = True, timeout: float = 300,
               **env: str) -> tuple[int, int]:
        """Submit `script` (as written, no options changed inside it); (job id, exit status of sbatch --wait)."""
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *opts, str(script)]
        p = subprocess.run(cmd, env=self.env(**env), capture_output=True, text=True, timeout=timeout)
        first = p.stdout.strip().splitlines()[:1]
        if not first or not first[0].split(";")[0].isdigit():
            raise RuntimeError(f"sbatch {script} refused ({p.returncode}): {p.stderr.strip()}")
        return int(first[0].split(";")[0]), p.returncode

"""A one-node Slurm cluster on this machine, for the tests of the cluster path against real Slurm
(tests/test_slurm.py, ``make test-slurm``).

:func:`one_node_slurm` starts, in a fresh folder, the daemons a site runs: munge (authentication), MariaDB with
slurmdbd (accounting: ``sacct``, which submitit reads a job's state from), slurmctld and one slurmd whose node
has this machine's cores. Every daemon runs in the foreground as a child of the caller, on ports the OS hands
out, with its configuration, state, sockets and logs in the folder, so nothing of the machine's own setup is
read or changed; leaving the context ends them. Clients (``sbatch``, ``squeue``, ``sacct``, ``scancel``) find the
cluster through ``SLURM_CONF``, which the returned environment sets and every command started with it inherits,
as the jobs inherit the submitter's environment.

The daemons run as root (the Slurm user and the job's user alike), as in a container; the binaries come from
Debian's packages (``make test-slurm`` installs them: :data:`PACKAGES`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurmdbd", "slurm-client", "munge", "mariadb-server")
BINARIES = ("munged", "mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "slurmctld", "slurmd", "sacctmgr",
            "sinfo", "sbatch", "sacct", "scancel")
CLUSTER = "pcaf"
PARTITION = "debug"


class SlurmUnavailable(RuntimeError):
    """The binaries are missing or a daemon did not come up; the message says which and what to do."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, logs: list[Path], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs if p.exists())
    raise SlurmUnavailable(f"timed out waiting for {what}\n{tails}")


def _ok(cmd: list[str], env: dict[str, str]) -> bool:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def one_node_slurm() -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment its clients need (``os.environ`` plus ``SLURM_CONF``)."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the one-node Slurm runs its daemons as root: run `make test-slurm` as root")
    if missing := missing_binaries():
        raise SlurmUnavailable(f"{', '.join(missing)} not found: `make test-slurm` installs Debian's "
                               f"{' '.join(PACKAGES)} (or apt-get install them)")
    # A short path: the daemons' Unix sockets must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="pcaf-slurm-"))
    logs = root / "log"
    for d in ("log", "state", "spool", "db"):
        (root / d).mkdir()
    node = socket.gethostname().split(".")[0]
    ports = {name: _free_port() for name in ("ctld", "slurmd", "dbd", "db")}
    munge_socket = root / "munge.sock"
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> None:
        procs.append(subprocess.Popen(cmd, stdout=(logs / log).open("w"), stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))

    try:
        key = root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        start(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
               f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munge.seed'}",
               f"--log-file={logs / 'munged.log'}"], "munged.out")
        _wait(munge_socket.exists, "munged", [logs / "munged.out", logs / "munged.log"])

        db_socket = root / "db.sock"
        subprocess.run(["mariadb-install-db", "--user=root", f"--datadir={root / 'db'}",
                        "--auth-root-authentication-method=normal"], check=True, capture_output=True, timeout=120)
        start(["mariadbd", "--no-defaults", "--user=root", f"--datadir={root / 'db'}", f"--socket={db_socket}",
               "--bind-address=127.0.0.1", f"--port={ports['db']}", f"--pid-file={root / 'db.pid'}"], "mariadb.log")
        sql = ["mariadb", "--no-defaults", f"--socket={db_socket}", "-uroot", "-e"]
        _wait(lambda: _ok([*sql, "select 1"], env), "MariaDB", [logs / "mariadb.log"])
        subprocess.run([*sql, "create database slurm_acct_db; create user 'slurm'@'127.0.0.1' identified by 'pcaf';"
                        " grant all on slurm_acct_db.* to 'slurm'@'127.0.0.1';"], check=True, timeout=30)

        # cred_expire: a job step credential's lifetime, which is also how long Slurm holds a requeued job before it
        # may start again (120 s by default): 10 s here, so a requeue takes seconds.
        auth = f"AuthType=auth/munge\nAuthInfo=socket={munge_socket},cred_expire=10\n"
        dbd_conf = root / "slurmdbd.conf"  # read from beside slurm.conf
        dbd_conf.write_text(
            f"{auth}DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={ports['dbd']}\nSlurmUser=root\n"
            f"LogFile={logs / 'slurmdbd.log'}\nPidFile={root / 'slurmdbd.pid'}\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={ports['db']}\n"
            f"StorageUser=slurm\nStoragePass=pcaf\nStorageLoc=slurm_acct_db\n")
        dbd_conf.chmod(0o600)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        (root / "slurm.conf").write_text(
            f"ClusterName={CLUSTER}\nSlurmctldHost={node}(127.0.0.1)\n{auth}SlurmUser=root\nSlurmdUser=root\n"
            f"SlurmctldPort={ports['ctld']}\nSlurmdPort={ports['slurmd']}\n"
            f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root / 'spool'}\n"
            f"SlurmctldPidFile={root / 'slurmctld.pid'}\nSlurmdPidFile={root / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={logs / 'slurmctld.log'}\nSlurmdLogFile={logs / 'slurmd.log'}\n"
            # No cgroups in a container: processes are tracked through /proc, and no task plugin binds them.
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\nReturnToService=2\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSchedulerType=sched/backfill\n"
            # A pending job waits for the next pass of a scheduler (every 60 s, backfill's every 30 s by default).
            "SchedulerParameters=sched_interval=1,bf_interval=1\n"
            # A cancelled job's processes get SIGTERM, then SIGKILL KillWait seconds later (30 by default): a job
            # process ignores SIGTERM (submitit waits for USR2), so its job stays COMPLETING until then.
            "KillWait=3\n"
            "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
            # The munge socket of connections to slurmdbd (AuthInfo serves the others).
            f"AccountingStoragePort={ports['dbd']}\nAccountingStoragePass={munge_socket}\n"
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb * 4 // 5} State=UNKNOWN\n"
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")

        start(["slurmdbd", "-D"], "slurmdbd.out")
        _wait(lambda: _ok(["sacctmgr", "-i", "add", "cluster", CLUSTER], env), "slurmdbd",
              [logs / "slurmdbd.out", logs / "slurmdbd.log"])
        start(["slurmctld", "-D"], "slurmctld.out")
        start(["slurmd", "-D", "-N", node], "slurmd.out")

        def node_idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            return out.returncode == 0 and out.stdout.strip() == "idle"

        _wait(node_idle, "the node to be idle",
              [logs / n for n in ("slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log")])
        yield env
    finally:
        if procs and shutil.which("scancel"):  # jobs first
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
            with contextlib.suppress(SlurmUnavailable):
                _wait(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True,
                                                 timeout=30).stdout.strip(), "the jobs to end", [], timeout=30)
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        _kill_strays(env["SLURM_CONF"])
        shutil.rmtree(root, ignore_errors=True)


def _kill_strays(conf: str) -> None:
    """End what the cluster left behind: a job step's daemon (slurmstepd, detached from slurmd) or a job's process
    that outlived the daemons. They are the processes whose environment names this cluster's ``SLURM_CONF``."""
    mark = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), 9)

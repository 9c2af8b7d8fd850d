"""poprun end to end: real poprun processes launching tiny Python programs written to tmp_path.

Also the pure parts: host lists, the topology table, output segmentation, the mpirun command.
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from popdist import options, poprun
from popdist.output import OutputRouter
from popdist.topology import HostlistError, Topology, expand_hostlist, is_local_host

POPRUN = [sys.executable, "-m", "popdist.poprun"]
PY = sys.executable


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def poprun_run(tmp_path, *args, env=None, timeout=120):
    return subprocess.run([*POPRUN, *map(str, args)], cwd=tmp_path, capture_output=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def poprun_start(tmp_path, *args, env=None):
    return subprocess.Popen([*POPRUN, *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie has finished)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for_files(paths, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() and p.read_text().endswith("\n") for p in paths):
            return
        time.sleep(0.02)
    raise AssertionError(f"instances did not start: {[str(p) for p in paths]}")


# An instance that starts a grandchild and sets its signals up as argv says, then records its pid
# and the grandchild's (the file pids.RANK appears whole, once the instance is ready); "raise" and
# "sigkill" fail once every instance is ready, the others sleep far longer than any test waits.
WORKER = """
    import os, signal, subprocess, sys, time
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    grandchild = subprocess.Popen(["sleep", "600"])
    mode = dict(arg.split("=") for arg in sys.argv[1:]).get(str(rank), "sleep")
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "ignore-int":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(f"pids.{rank}.part", "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}\\n")
    os.rename(f"pids.{rank}.part", f"pids.{rank}")
    if mode in ("raise", "sigkill"):
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"pids.{r}") for r in range(size)):
            if time.monotonic() > deadline:
                sys.exit(f"instance {rank}: the other instances were not ready within 60 s")
            time.sleep(0.01)
    if mode == "raise":
        raise RuntimeError(f"instance {rank} gives up")
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"instance {rank} sleeping", flush=True)
    time.sleep(600)
"""


def all_pids(tmp_path, count):
    return [int(p) for i in range(count) for p in (tmp_path / f"pids.{i}").read_text().split()]


def assert_no_survivors(pids):
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], "processes outlived poprun"


# --------------------------------------------------------------------------- environment


def test_environment_of_each_instance(tmp_path, monkeypatch):
    write(tmp_path, "env.py", """
        import json, os
        rank = os.environ["OMPI_COMM_WORLD_RANK"]
        json.dump(dict(os.environ), open(f"env.{rank}.json", "w"))
    """)
    env = {**os.environ, "FROM_POPRUN": "inherited"}
    env.pop("PYTHONUNBUFFERED", None)
    done = poprun_run(tmp_path, "--num-instances", 2, "--num-replicas", 8,
                      "--ipus-per-replica", 2, "--executable-cache-path", "cache",
                      "--mpi-local-args", "-x A=1 -x FROM_POPRUN", "--mpi-local-args", "-x B=2",
                      "--instance-mpi-local-args", "1:-x A=one",
                      PY, "env.py", env=env)
    assert done.returncode == 0, done.stderr.decode()
    envs = [json.loads((tmp_path / f"env.{i}.json").read_text()) for i in range(2)]
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for index, seen in enumerate(envs):
        expected = {
            "POPDIST_NUM_TOTAL_REPLICAS": "8", "POPDIST_NUM_IPUS_PER_REPLICA": "2",
            "POPDIST_NUM_LOCAL_REPLICAS": "4", "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
            "POPDIST_REPLICA_INDEX_OFFSET": str(4 * index),
            "POPDIST_LOCAL_INSTANCE_INDEX": str(index),
            "OMPI_COMM_WORLD_RANK": str(index), "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(index), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "RANK": str(index), "WORLD_SIZE": "2",
            "LOCAL_RANK": str(index), "LOCAL_WORLD_SIZE": "2",
            "POPTORCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
            "A": "one" if index else "1", "B": "2", "FROM_POPRUN": "inherited",
        }
        assert {k: seen.get(k) for k in expected} == expected
    assert (tmp_path / "cache").is_dir()


def test_vipu_options_are_checked_reported_and_exported(tmp_path):
    write(tmp_path, "env.py", """
        import os
        print(" ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("IPUOF")))
    """)
    done = poprun_run(tmp_path, "-v", "--vipu-server-host", "vipu.example", "--vipu-server-port",
                      9000, "--vipu-partition", "p-test", "--reset-partition", "yes",
                      "--vipu-cluster", "c1", "--offline-mode", "--num-instances", 2,
                      "--num-replicas", 2, "--num-ilds", 2, PY, "env.py")
    assert done.returncode == 0, done.stderr.decode()
    err = done.stderr.decode()
    assert "--vipu-cluster is deprecated" in err
    assert re.search(r"\[I\] V-IPU: server vipu\.example:9000 .*partition 'p-test'.*reset yes"
                     r".*allocation 'c1'; not contacted.*offline mode", err)
    lines = sorted(done.stdout.decode().splitlines())
    for ild, line in enumerate(lines):
        assert line == (f"IPUOF_VIPU_API_GCD_ID={ild} IPUOF_VIPU_API_HOST=vipu.example "
                        "IPUOF_VIPU_API_PARTITION_ID=p-test IPUOF_VIPU_API_PORT=9000 "
                        "IPUOF_VIPU_API_TIMEOUT=120")


def test_numa_aware_binds_instances(tmp_path):
    write(tmp_path, "cpus.py", "import os; print(sorted(os.sched_getaffinity(0)))\n")
    done = poprun_run(tmp_path, "-v", "--numa-aware=yes", PY, "cpus.py")
    assert done.returncode == 0, done.stderr.decode()
    nodes = poprun.numa_nodes()
    if nodes:
        expected = sorted(nodes[0] & os.sched_getaffinity(0))
        assert done.stdout.decode().strip() == str(expected)
        assert "instance 0: NUMA node 0" in done.stderr.decode()
    else:
        assert "reports no NUMA nodes" in done.stderr.decode()


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("args, message", [
    (["--num-instances", "3", "--num-replicas", "4"],
     "--num-replicas 4 is not divisible by --num-instances 3"),
    (["-H", "localhost,127.0.0.1", "--num-instances", "3", "--num-replicas", "3"],
     r"--num-instances 3 is not divisible by the 2 hosts \(localhost, 127\.0\.0\.1\)"),
    (["-H", "localhost,localhost", "--num-instances", "2", "--num-replicas", "2"],
     "host localhost is listed more than once"),
    (["--num-instances", "2", "--num-replicas", "2", "--num-ilds", "4"],
     "not divisible by --num-ilds 4"),
    (["--num-replcias", "2"], "unknown option '--num-replcias'; did you mean '--num-replicas'"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
    (["--num-replicas", "four"], "option '--num-replicas' expects a positive integer, got 'four'"),
    (["--num-replicas=0"], "expects a positive integer, got '0'"),
    (["--vipu-server-port", "70000"], r"expects a port number \(1-65535\), got '70000'"),
    (["--print-topology=perhaps"], "expects yes or no"),
    (["--only-output-from-instance", "2", "--num-instances", "2", "--num-replicas", "2"],
     r"there are only 2 instances \(0\.\.1\)"),
    (["--instance-mpi-local-args", "5:-x A=1"], "names instance 5, but there are only 1"),
    (["--instance-mpi-local-args", "-x A=1"], "expects INDEX:ARGS"),
    (["--mpi-local-args", "-x"], "'-x' at the end of --mpi-local-args"),
    (["--mpi-global-args", "--bind-to core"], "have no meaning for local instances"),
    (["-H", "node[03-01]"], "descending range '03-01'"),
    (["--vipu-cluster", "a", "--vipu-allocation", "b"], "give only --vipu-allocation"),
    (["--vipu-partition", "bad name"], "is not a valid name"),
    (["--launcher", "ssh"], "--launcher expects auto, local or mpirun"),
])
def test_bad_command_lines_start_nothing(tmp_path, args, message):
    marker = write(tmp_path, "marker.py", "open('started', 'w').close()\n")
    done = poprun_run(tmp_path, *args, PY, marker)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert re.search(message, err), err
    assert err.startswith("poprun: error: ") and "poprun --help" in err
    assert not (tmp_path / "started").exists()


def test_missing_and_unusable_programs(tmp_path):
    done = poprun_run(tmp_path, "--num-replicas", 2)
    assert done.returncode == 2 and b"no program given" in done.stderr
    done = poprun_run(tmp_path, "--num-replicas")
    assert done.returncode == 2 and b"option '--num-replicas' needs a value (N)" in done.stderr
    done = poprun_run(tmp_path, "no-such-program-xyz")
    assert done.returncode == 2
    assert b"'no-such-program-xyz' not found: it is neither a command in PATH" in done.stderr
    write(tmp_path, "train.py", "print('trained')\n")
    done = poprun_run(tmp_path, "train.py")
    assert done.returncode == 2 and b"poprun ... python3 train.py" in done.stderr
    done = poprun_run(tmp_path, "./missing.py")
    assert done.returncode == 2 and b"'./missing.py' does not exist" in done.stderr


def test_program_in_current_directory_runs_without_dot_slash(tmp_path):
    script = write(tmp_path, "hello", f"#!{PY}\nimport sys; print('hello', sys.argv[1:])\n")
    script.chmod(0o755)
    done = poprun_run(tmp_path, "hello", "--flag", "x")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b"hello ['--flag', 'x']\n"


def test_help_and_version(tmp_path):
    done = poprun_run(tmp_path, "--help")
    assert done.returncode == 0
    text = done.stdout.decode()
    assert text.startswith("Usage: poprun [options] program [program args]")
    for option in options.OPTIONS:
        for name in option.names:
            assert re.search(rf"(^|\s|, ){re.escape(name)}(\s|,|$)", text, re.M), name
    assert max(len(line) for line in text.splitlines()) <= 100
    assert poprun_run(tmp_path, "--version").stdout.startswith(b"poprun ")


# --------------------------------------------------------------------------- output


def test_tagged_output_and_output_files(tmp_path):
    write(tmp_path, "talk.py", """
        import os, sys, time
        rank = os.environ["OMPI_COMM_WORLD_RANK"]
        print(f"hello from {rank}")
        for step in range(3):
            sys.stderr.write(f"\\rprogress {rank}: {step}/3")
            sys.stderr.flush()
            time.sleep(0.01)
        sys.stderr.write("\\n")
        print("", end="")
        print(f"bye from {rank}")
    """)
    done = poprun_run(tmp_path, "--num-instances", 2, "--num-replicas", 2,
                      "--mpi-global-args=--tag-output --output-filename logs", PY, "talk.py")
    assert done.returncode == 0, done.stderr.decode()
    out_lines = done.stdout.decode().splitlines()
    assert sorted(out_lines) == ["[1,0]<stdout>:bye from 0", "[1,0]<stdout>:hello from 0",
                                 "[1,1]<stdout>:bye from 1", "[1,1]<stdout>:hello from 1"]
    segments = [s for s in re.split(r"[\r\n]", done.stderr.decode()) if s]
    bars = [s for s in segments if "progress" in s]
    assert len(bars) == 6
    assert all(re.fullmatch(r"\[1,(\d)\]<stderr>:progress \1: [0-2]/3", s) for s in bars), bars
    for rank in range(2):
        directory = tmp_path / "logs" / "1" / f"rank.{rank}"
        assert (directory / "stdout").read_bytes() == \
            f"hello from {rank}\nbye from {rank}\n".encode()
        assert (directory / "stderr").read_bytes() == "".join(
            f"\rprogress {rank}: {step}/3" for step in range(3)).encode() + b"\n"


def test_output_files_without_terminal_copy(tmp_path):
    write(tmp_path, "talk.py", "print('only in the file')\n")
    done = poprun_run(tmp_path, "--mpi-global-args", "--output-filename=logs:nocopy", PY,
                      "talk.py")
    assert done.returncode == 0 and done.stdout == b""
    assert (tmp_path / "logs/1/rank.0/stdout").read_text() == "only in the file\n"


def test_output_streams_live(tmp_path):
    """The program goes on only once the test has seen its first line and its open partial line:
    poprun shows them while the program runs."""
    write(tmp_path, "slow.py", """
        import os, sys, time
        print("first line")
        sys.stdout.write("partial line without newline")
        deadline = time.monotonic() + 60
        while not os.path.exists("seen"):
            if time.monotonic() > deadline:
                print(" ...not seen within 60 s")
                sys.exit(1)
            time.sleep(0.01)
        print(" ...finished")
    """)
    expected = b"[1,0]<stdout>:first line\n[1,0]<stdout>:partial line without newline"
    process = poprun_start(tmp_path, "--mpi-global-args=--tag-output", PY, "slow.py")
    try:
        shown = b""
        while len(shown) < len(expected):
            chunk = os.read(process.stdout.fileno(), 1000)
            if not chunk:
                break
            shown += chunk
        (tmp_path / "seen").touch()
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert shown == expected, (shown, err)
    assert rest == b" ...finished\n"
    assert process.returncode == 0


def test_only_output_from_one_instance(tmp_path):
    write(tmp_path, "talk.py", """
        import os, sys, time
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        if rank:
            open(f"written.{rank}", "w").close()
        else:  # fail once the others have written their lines
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f"written.{r}") for r in (1, 2)):
                assert time.monotonic() < deadline, "the other instances did not write within 60 s"
                time.sleep(0.01)
            sys.exit(3)
    """)
    done = poprun_run(tmp_path, "--num-instances", 3, "--num-replicas", 3,
                      "--only-output-from-instance", 1, PY, "talk.py")
    assert done.returncode == 3
    assert done.stdout == b"out 1\n"
    err = done.stderr.decode()
    assert "err 1\n" in err and "err 2" not in err
    assert "instance 0 (pid" in err and "failed first: it exited with code 3" in err
    assert "last lines instance 0 wrote to stderr:\n    err 0" in err


# --------------------------------------------------------------------------- topology


def test_print_topology(tmp_path):
    write(tmp_path, "nothing.py", "")
    done = poprun_run(tmp_path, "--print-topology=yes", "-H", "localhost,127.0.0.1",
                      "--num-instances", 4, "--num-replicas", 8, "--ipus-per-replica", 2,
                      "--num-ilds", 2, PY, "nothing.py")
    assert done.returncode == 0, done.stderr.decode()
    table = done.stdout.decode().splitlines()
    assert "poprun topology" in table[1]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table if line.startswith("| ") and "topology" not in line}
    assert rows == {"hosts": ["localhost", "127.0.0.1"], "ILDs": ["0", "1"],
                    "instances": ["0", "1", "2", "3"], "replicas": [str(r) for r in range(8)],
                    "IPUs": [f"{2 * r}-{2 * r + 1}" for r in range(8)]}
    assert len({len(line) for line in table}) == 1


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 4]))
def test_topology_table_cells_align(hosts, instances_per_host, replicas_per_instance, ipus):
    instances = hosts * instances_per_host
    layout = Topology.build([f"host-with-long-name{h}" for h in range(hosts)],
                            instances * replicas_per_instance, ipus, instances)
    lines = layout.table().splitlines()
    assert len({len(line) for line in lines}) == 1
    bars = [{i for i, c in enumerate(line) if c == "|"} for line in lines if line[:2] == "| "]
    finest = bars[-1]
    assert all(row <= finest for row in bars)  # every cell boundary is a replica boundary


def test_placement_and_slurm_hosts():
    layout = Topology.build(expand_hostlist("n[1-2]"), 8, 1, 4, num_ilds=2)
    places = [layout.placement(i) for i in range(4)]
    assert [p.host for p in places] == ["n1", "n1", "n2", "n2"]
    assert [p.local_index for p in places] == [0, 1, 0, 1]
    assert [p.ild for p in places] == [0, 0, 1, 1]
    assert [list(p.replicas) for p in places] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("spec, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b[8-10],c", ["a", "b8", "b9", "b10", "c"]),
    ("gpu[098-100]", ["gpu098", "gpu099", "gpu100"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("host0", ["host0"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[1-", "node1]", "a,,b", "n[a-b]", "n[[1]]", ""])
def test_bad_hostlists(spec):
    with pytest.raises(HostlistError):
        expand_hostlist(spec)


@given(st.integers(0, 500), st.integers(0, 50), st.integers(1, 4))
def test_hostlist_ranges_expand_to_every_number(first, length, width):
    low = str(first).zfill(width)
    high = str(first + length).zfill(width)
    hosts = expand_hostlist(f"h[{low}-{high}]")
    assert len(hosts) == length + 1
    assert [int(h[1:]) for h in hosts] == list(range(first, first + length + 1))


def test_local_host_detection():
    import socket

    for host in ("localhost", "127.0.0.1", "127.0.0.2", "::1", socket.gethostname()):
        assert is_local_host(host), host
    for host in ("no-such-host.invalid", "192.0.2.254", "8.8.8.8"):
        assert not is_local_host(host), host


def test_slurm_allocation_gives_the_hosts(tmp_path):
    write(tmp_path, "nothing.py", "")
    env = {**os.environ, "SLURM_JOB_NODELIST": "localhost"}
    done = poprun_run(tmp_path, "-v", PY, "nothing.py", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert "hosts from the Slurm allocation (SLURM_JOB_NODELIST=localhost)" in \
        done.stderr.decode()
    env["SLURM_JOB_NODELIST"] = "node[01-02]"
    done = poprun_run(tmp_path, PY, "nothing.py", env=env)
    assert done.returncode == 2
    assert "not divisible by the 2 hosts (node01, node02)" in done.stderr.decode()
    assert "SLURM_JOB_NODELIST=node[01-02]); give -H to choose" in done.stderr.decode()


# --------------------------------------------------------------------------- failures


def test_instance_that_raises_stops_the_others(tmp_path):
    write(tmp_path, "worker.py", WORKER)
    start = time.monotonic()
    done = poprun_run(tmp_path, "--num-instances", 3, "--num-replicas", 3,
                      PY, "worker.py", "1=raise")
    elapsed = time.monotonic() - start
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert elapsed < 60  # the others, which would sleep 600 s, were stopped
    assert "RuntimeError: instance 1 gives up" in err
    assert re.search(r"instance 1 \(pid \d+ on localhost\) failed first: it exited with code 1",
                     err)
    assert "instance 0 was killed by signal SIGTERM (poprun sent SIGTERM)" in err
    assert_no_survivors(all_pids(tmp_path, 3))


def test_instance_killed_by_sigkill_is_reported_as_such(tmp_path):
    write(tmp_path, "worker.py", WORKER)
    done = poprun_run(tmp_path, "--num-instances", 2, "--num-replicas", 2,
                      "--termination-grace-period", "0.5", PY, "worker.py", "0=sigkill",
                      "1=ignore-term")
    err = done.stderr.decode()
    assert done.returncode == 128 + signal.SIGKILL, err
    assert "instance 0 was killed by signal SIGKILL; terminating the other instances" in err
    assert "failed first: it was killed by signal SIGKILL" in err
    assert "instance 1 was killed by signal SIGKILL (poprun sent SIGTERM)" in err
    assert_no_survivors(all_pids(tmp_path, 2))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_to_poprun_reach_every_instance(tmp_path, signum):
    """The instances end of the signal poprun forwards: with a grace period longer than the
    test waits, none is left for poprun's SIGKILL."""
    write(tmp_path, "worker.py", WORKER)
    process = poprun_start(tmp_path, "--num-instances", 2, "--num-replicas", 2,
                           "--termination-grace-period", 600, PY, "worker.py")
    wait_for_files([tmp_path / "pids.0", tmp_path / "pids.1"])
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    text = err.decode()
    name = signal.Signals(signum).name
    assert f"received {name}: forwarding it to every instance" in text
    assert f"interrupted by {name}" in text
    assert_no_survivors(all_pids(tmp_path, 2))


def test_second_interrupt_kills_at_once(tmp_path):
    write(tmp_path, "worker.py", WORKER)
    process = poprun_start(tmp_path, "--num-instances", 2, "--num-replicas", 2,
                           "--termination-grace-period", 60, PY, "worker.py", "0=ignore-int",
                           "1=ignore-int")
    wait_for_files([tmp_path / "pids.0", tmp_path / "pids.1"])
    process.send_signal(signal.SIGINT)
    told = b""
    while b"received SIGINT: forwarding it" not in told:
        line = process.stderr.readline()
        assert line, told
        told += line
    assert process.poll() is None  # the instances ignore SIGINT; poprun waits for them
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    err = told + err
    assert process.returncode == 128 + signal.SIGINT
    assert b"received SIGINT again: killing every instance now" in err
    assert_no_survivors(all_pids(tmp_path, 2))


def test_poprun_killed_outright_leaves_no_instances(tmp_path):
    write(tmp_path, "worker.py", WORKER)
    process = poprun_start(tmp_path, "--num-instances", 2, "--num-replicas", 2, PY, "worker.py")
    wait_for_files([tmp_path / "pids.0", tmp_path / "pids.1"])
    process.kill()
    process.communicate(timeout=60)
    instances = [int((tmp_path / f"pids.{i}").read_text().split()[0]) for i in range(2)]
    assert_no_survivors(instances)  # the kernel ends them (parent-death signal)
    for grandchild in all_pids(tmp_path, 2)[1::2]:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)  # only poprun's clean-up reaches these


# --------------------------------------------------------------------------- OutputRouter


def routed(tag_output=True, **kwargs):
    out, err = io.BytesIO(), io.BytesIO()
    router = OutputRouter(tag_output=tag_output, terminal={"stdout": out, "stderr": err},
                          **kwargs)
    router.add_instance(0)
    router.add_instance(1)
    return router, out, err


def test_router_segments_and_open_lines():
    router, out, err = routed()
    router.feed(0, "stderr", b"\rbar 1\rbar", now=0.0)
    router.feed(1, "stdout", b"loading", now=0.0)
    router.feed(0, "stderr", b" 2\r\n", now=0.1)
    router.flush_stale(now=1.0)  # "loading" waited long enough: shown without its line end
    router.feed(0, "stdout", b"zero\n", now=1.1)  # ends instance 1's open line first
    router.feed(1, "stdout", b" done\nwindows\r\n", now=1.2)
    for index in range(2):
        for stream in ("stdout", "stderr"):
            router.close(index, stream)
    assert err.getvalue() == b"[1,0]<stderr>:bar 1\r[1,0]<stderr>:bar 2\r\n"
    assert out.getvalue() == (b"[1,1]<stdout>:loading\n[1,0]<stdout>:zero\n"
                              b"[1,1]<stdout>: done\n[1,1]<stdout>:windows\r\n")


def test_router_untagged_keeps_bytes_and_keeps_tails():
    router, out, err = routed(tag_output=False, only_instance=0)
    router.feed(0, "stdout", b"a\rb\nc", now=0.0)
    router.feed(1, "stderr", b"hidden 1\nhidden 2\nlast", now=0.0)
    router.close(0, "stdout")
    router.close(1, "stderr")
    assert out.getvalue() == b"a\rb\nc\n" and err.getvalue() == b""
    assert router.tail(1) == ["hidden 1", "hidden 2", "last"]


def test_router_survives_a_closed_terminal():
    class Closed(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError

    router = OutputRouter(terminal={"stdout": Closed(), "stderr": io.BytesIO()})
    router.add_instance(0)
    router.feed(0, "stdout", b"nobody reads this\n")
    router.feed(0, "stdout", b"nor this\n")


def test_instance_wrapper_exits_like_its_program(tmp_path):
    """The per-instance side of an mpirun launch, run directly."""
    wrapper = [PY, "-m", "popdist._instance", "--index", "0"]
    killed = subprocess.run([*wrapper, "--", PY, "-c",
                             "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                            capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert b"the program was killed by signal SIGKILL" in killed.stderr
    quiet = subprocess.run([*wrapper, "--only-output-from-instance", "1", "--output-filename",
                            tmp_path / "logs", "--", PY, "-c",
                            "import sys; print('hidden'); sys.exit('fatal: bad input')"],
                           capture_output=True, timeout=60)
    assert quiet.returncode == 1 and quiet.stdout == b""
    assert b"the program exited with code 1" in quiet.stderr
    assert b"    fatal: bad input" in quiet.stderr  # hidden, so its last lines are shown
    assert (tmp_path / "logs/1/rank.0/stdout").read_bytes() == b"hidden\n"
    missing = subprocess.run([*wrapper, "--", "/no/such/program"], capture_output=True,
                             timeout=60)
    assert missing.returncode == 127 and b"cannot start /no/such/program" in missing.stderr


# --------------------------------------------------------------------------- mpirun


def test_mpirun_command_line_for_two_hosts():
    args = options.parse_command_line([
        "--launcher", "mpirun", "-H", "node-a.invalid,node-b.invalid", "--num-instances", "4",
        "--num-replicas", "8", "--mpi-global-args", "--tag-output --mca btl tcp,self",
        "--mpi-local-args", "-x A=1", "--instance-mpi-local-args", "3:-x A=3 --nice 1",
        "--only-output-from-instance", "2", PY, "train.py", "--epochs", "2"])
    environ = {"PATH": os.environ["PATH"], "HOME": "/root"}
    plan = poprun.make_plan(args, environ, poprun.Log(0))
    command = poprun.mpirun_command(plan, "/usr/bin/mpirun", environ)
    contexts = " ".join(command).split(" : ")
    assert len(contexts) == 4
    head = command[:command.index("-np")]
    assert head[:6] == ["/usr/bin/mpirun", "--bind-to", "none", "--mca", "plm_rsh_args",
                        "-o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10"]
    assert head[6:] == ["--mca", "btl", "tcp,self"]
    for index, context in enumerate(contexts):
        host = "node-a.invalid" if index < 2 else "node-b.invalid"
        assert f"-np 1 --host {host}:2 -x PATH " in context
        assert f"-x POPDIST_REPLICA_INDEX_OFFSET={2 * index} " in context
        assert f"-x POPDIST_LOCAL_INSTANCE_INDEX={index % 2} " in context
        assert "-x MASTER_ADDR=node-a.invalid " in context and f"-x RANK={index} " in context
        assert "OMPI_COMM_WORLD" not in context  # mpirun sets those itself
        assert context.count("-x MASTER_PORT=") == 1
        assert (f"-m popdist._instance --grace 5 --tag-output --only-output-from-instance 2 "
                f"--index {index} -- {PY} train.py --epochs 2") in context
    assert contexts[3].count("-x A=") == 1 and "-x A=3 --nice 1" in contexts[3]
    assert "-x A=1 " in contexts[0]


def test_ssh_errors_are_named_per_host():
    assert "ssh-keyscan h1" in poprun.ssh_diagnosis("h1", "Host key verification failed.\r\n")
    assert "permission denied" in poprun.ssh_diagnosis(
        "h2", "user@h2: Permission denied (publickey).")
    assert "does not resolve" in poprun.ssh_diagnosis(
        "h3", "ssh: Could not resolve hostname h3: Name or service not known")


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun not installed (apt-get install openmpi-bin)")


@needs_mpirun
def test_unreachable_host_fails_fast_naming_it(tmp_path):
    marker = write(tmp_path, "marker.py", "open('started', 'w').close()\n")
    start = time.monotonic()
    done = poprun_run(tmp_path, "-H", "localhost,unreachable-host.invalid", "--num-instances", 2,
                      "--num-replicas", 2, "--allow-run-as-root", PY, marker)
    assert time.monotonic() - start < 60  # ssh has 10 s to answer; mpirun never starts
    assert done.returncode == 1
    assert b"ssh to unreachable-host.invalid: the host name does not resolve" in done.stderr
    assert not (tmp_path / "started").exists()


@needs_mpirun
def test_two_instances_through_mpirun(tmp_path):
    write(tmp_path, "env.py", """
        import os, sys
        keys = ("POPDIST_REPLICA_INDEX_OFFSET", "POPDIST_NUM_LOCAL_REPLICAS",
                "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "A")
        print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
        sys.stderr.write("\\rstep 1\\rstep 2\\n")
    """)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = poprun_run(tmp_path, "--launcher", "mpirun", "--num-instances", 2, "--num-replicas",
                      4, "--mpi-global-args", "--tag-output --output-filename logs",
                      "--instance-mpi-local-args", "1:-x A=7", PY, "env.py", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert sorted(done.stdout.decode().splitlines()) == [
        "[1,0]<stdout>:POPDIST_REPLICA_INDEX_OFFSET=0 POPDIST_NUM_LOCAL_REPLICAS=2 "
        "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 RANK=0 A=None",
        "[1,1]<stdout>:POPDIST_REPLICA_INDEX_OFFSET=2 POPDIST_NUM_LOCAL_REPLICAS=2 "
        "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 RANK=1 A=7"]
    segments = [s for s in re.split(r"[\r\n]", done.stderr.decode()) if "step" in s]
    assert sorted(segments) == [f"[1,{r}]<stderr>:step {s}" for r in (0, 1) for s in (1, 2)]
    assert (tmp_path / "logs/1/rank.1/stderr").read_bytes() == b"\rstep 1\rstep 2\n"


@needs_mpirun
def test_failure_through_mpirun(tmp_path):
    write(tmp_path, "worker.py", WORKER)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    start = time.monotonic()
    done = poprun_run(tmp_path, "--launcher", "mpirun", "--num-instances", 2, "--num-replicas",
                      2, PY, "worker.py", "1=raise", env=env, timeout=120)
    assert time.monotonic() - start < 60  # the other instance, which would sleep 600 s, was stopped
    err = done.stderr.decode()
    assert done.returncode != 0, err
    assert "RuntimeError: instance 1 gives up" in err
    assert "instance 1 on" in err and "the program exited with code 1" in err
    assert_no_survivors(all_pids(tmp_path, 2))


@needs_mpirun
def test_mpirun_as_root_needs_permission(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only meaningful as root")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW")}
    done = poprun_run(tmp_path, "--launcher", "mpirun", PY, "-c", "pass", env=env)
    assert done.returncode == 1 and b"--allow-run-as-root=yes" in done.stderr

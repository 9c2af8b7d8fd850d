"""`poprun [options] program [program args]`: launch a program as several PopDist instances.

Every instance gets the PopDist environment (POPDIST_*), the OpenMPI rank variables and a
torch.distributed rendezvous (MASTER_ADDR/MASTER_PORT, gloo over TCP). When every host is this
machine the instances are local child processes; otherwise the job goes through OpenMPI's
`mpirun`, one application context per instance (as PopRun does), each wrapped by
`python -m popdist._instance`, which gives the same output handling as a local run.

Everything is checked before anything starts: options and their values, the division of
replicas among instances and of instances among hosts and IPU-Link domains, the program, and
(for remote hosts) that non-interactive ssh reaches every host.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from popdist import topology as topo
from popdist.options import (
    USAGE,
    CommandLine,
    GlobalArgs,
    LocalArgs,
    UsageError,
    help_text,
    parse_command_line,
    parse_global_args,
    parse_instance_local_args,
    parse_local_args,
)
from popdist.output import OutputRouter
from popdist.supervisor import InstanceCommand, Supervisor, SupervisionResult, signal_name

VERSION = "0.1.0"
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes")
SSH_CONNECT_TIMEOUT = 10
ERROR_STATUS = 2
LAUNCH_ERROR_STATUS = 1


class LaunchError(Exception):
    """The command line is fine but the job cannot start (hosts, mpirun, permissions)."""


# --------------------------------------------------------------------------- checks


def resolve_program(program: str) -> str:
    """The path to run for `program`: a path, a command in PATH, or a file in the current
    directory (which runs without './')."""
    if "/" in program:
        path = Path(program)
        if not path.exists():
            raise UsageError(f"program '{program}' does not exist")
        if path.is_dir():
            raise UsageError(f"program '{program}' is a directory")
        if not os.access(path, os.X_OK):
            raise UsageError(f"program '{program}' is not executable: chmod +x it, or run it "
                             f"through its interpreter (poprun ... python3 {program})")
        return str(path)
    found = shutil.which(program)
    if found:
        return found
    local = Path(program)
    if local.is_file():
        if os.access(local, os.X_OK):
            return str(local.resolve())
        raise UsageError(f"'{program}' is in the current directory but is not executable: run "
                         f"it through its interpreter (poprun ... python3 {program}) or "
                         f"chmod +x {program}")
    raise UsageError(f"program '{program}' not found: it is neither a command in PATH nor a "
                     "file in the current directory")


def check_vipu(args: CommandLine) -> list[str]:
    """Validate the V-IPU options; return warnings."""
    warnings = []
    host = args.vipu_server_host
    if any(char.isspace() for char in host):
        raise UsageError(f"--vipu-server-host '{host}' is not a host name or address")
    for option, value in (("--vipu-partition", args.vipu_partition),
                          ("--vipu-allocation", args.vipu_allocation),
                          ("--vipu-cluster", args.vipu_cluster)):
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", value):
            raise UsageError(f"{option} '{value}' is not a valid name (letters, digits, '_', "
                             "'.', '-'; starting with a letter or digit)")
    if args.vipu_cluster is not None and args.vipu_allocation is not None:
        raise UsageError("--vipu-cluster and --vipu-allocation name the same thing: give only "
                         "--vipu-allocation")
    if args.vipu_cluster is not None:
        warnings.append("--vipu-cluster is deprecated: use --vipu-allocation")
    return warnings


def vipu_report(args: CommandLine) -> str:
    parts = [f"server {args.vipu_server_host}:{args.vipu_server_port} "
             f"(timeout {args.vipu_server_timeout} s)"]
    if args.vipu_partition:
        reset = "default" if args.reset_partition is None else _yes(args.reset_partition)
        parts.append(f"partition '{args.vipu_partition}' (attempts "
                     f"{args.vipu_partition_attempts}, update {_yes(args.update_partition)}, "
                     f"reset {reset}, remove {_yes(args.remove_partition)})")
    allocation = args.vipu_allocation or args.vipu_cluster
    if allocation:
        parts.append(f"allocation '{allocation}'")
    return ("V-IPU: " + ", ".join(parts) + "; not contacted: the IPUs are emulated inside "
            "each instance" + (", offline mode" if args.offline_mode else ""))


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def numa_nodes(root: str = "/sys/devices/system/node") -> list[frozenset[int]]:
    """The CPUs of each NUMA node, by node number (empty when the system does not say)."""
    nodes = []
    for path in sorted(Path(root).glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpulist = (path / "cpulist").read_text().strip()
        cpus: set[int] = set()
        for part in filter(None, cpulist.split(",")):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
        if cpus:
            nodes.append(frozenset(cpus))
    return nodes


def check_ssh(hosts: list[str], timeout: float = SSH_CONNECT_TIMEOUT) -> list[str]:
    """Try a non-interactive ssh to every host at once; return one clear error per failure."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return ["ssh not found: mpirun starts remote instances through ssh; install an ssh "
                "client (Debian/Ubuntu: apt-get install openssh-client)"]
    attempts = {
        host: subprocess.Popen(
            [ssh, *SSH_OPTIONS, "-o", f"ConnectTimeout={int(timeout)}", host, "true"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        for host in hosts}
    deadline = time.monotonic() + timeout + 2
    errors = []
    for host, attempt in attempts.items():
        try:
            _, stderr = attempt.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            attempt.kill()
            attempt.communicate()
            errors.append(f"ssh to {host} did not answer within {timeout:g} s")
            continue
        if attempt.returncode != 0:
            errors.append(ssh_diagnosis(host, stderr.decode(errors="replace")))
    return errors


def ssh_diagnosis(host: str, stderr: str) -> str:
    """A clear message for an ssh failure, from ssh's own error text."""
    text = stderr.strip()
    last = text.splitlines()[-1] if text else "no message"
    if "Host key verification failed" in text or "No ED25519 host key is known" in text \
            or "host key for" in text.lower():
        return (f"ssh to {host}: its host key is unknown or has changed, and poprun does not "
                f"answer ssh's question; check and add it first, e.g. "
                f"ssh-keyscan {host} >> ~/.ssh/known_hosts")
    if "Permission denied" in text:
        return (f"ssh to {host}: permission denied; poprun needs password-less login, e.g. "
                f"ssh-copy-id {host} ({last})")
    if "Could not resolve hostname" in text or "Name or service not known" in text:
        return f"ssh to {host}: the host name does not resolve ({last})"
    if "Connection refused" in text:
        return f"ssh to {host}: connection refused (is sshd running there?)"
    if "timed out" in text:
        return f"ssh to {host}: connection timed out ({last})"
    return f"ssh to {host} failed: {last}"


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


# --------------------------------------------------------------------------- the launch


class Log:
    """PopRun-style log lines on stderr: `12:00:00.123 4242 POPRUN [I] message`."""

    def __init__(self, verbosity: int):
        self.verbosity = verbosity

    def info(self, message: str) -> None:
        if self.verbosity >= 1:
            self._write("I", message)

    def debug(self, message: str) -> None:
        if self.verbosity >= 2:
            self._write("D", message)

    def warning(self, message: str) -> None:
        self._write("W", message)

    def _write(self, level: str, message: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        print(f"{stamp} {os.getpid()} POPRUN [{level}] {message}", file=sys.stderr, flush=True)


def say(message: str) -> None:
    print(f"poprun: {message}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    """Everything decided before launching."""

    topology: topo.Topology
    hosts_source: str
    program: list[str]
    global_args: GlobalArgs
    local_args: LocalArgs
    instance_args: dict[int, LocalArgs]
    launcher: str  # "local" or "mpirun"
    shared_env: dict[str, str]  # variables every instance gets from poprun
    grace_seconds: float
    only_instance: int | None
    numa_aware: bool
    allow_run_as_root: bool


def make_plan(args: CommandLine, environ: dict[str, str], log: Log) -> Plan:
    """Check the command line against the environment and decide how to launch."""
    if not args.program:
        raise UsageError(f"no program given: usage is '{USAGE}'")
    if args.host is not None:
        try:
            hosts = topo.expand_hostlist(args.host)
        except topo.HostlistError as error:
            raise UsageError(f"-H/--host: {error}") from None
        source = "-H/--host"
    else:
        try:
            hosts, source = topo.default_hosts(environ)
        except topo.HostlistError as error:
            raise UsageError(f"the Slurm allocation's host list: {error}") from None
    try:
        layout = topo.Topology.build(hosts, args.num_replicas, args.ipus_per_replica,
                                     args.num_instances, args.num_ilds)
    except topo.TopologyError as error:
        if args.host is None and source.startswith("the Slurm"):
            raise UsageError(f"{error} (hosts from {source}; give -H to choose)") from None
        raise UsageError(str(error)) from None
    only = args.only_output_from_instance
    if only is not None and only >= layout.num_instances:
        raise UsageError(f"--only-output-from-instance {only}: there are only "
                         f"{layout.num_instances} instances (0..{layout.num_instances - 1})")
    global_args = parse_global_args(args.mpi_global_args)
    local_args = parse_local_args(args.mpi_local_args)
    instance_args = parse_instance_local_args(args.instance_mpi_local_args,
                                              layout.num_instances)
    for warning in check_vipu(args):
        log.warning(warning)
    for extra in (local_args, *instance_args.values()):
        for name, value in extra.exports.items():
            if value is None and name not in environ:
                log.warning(f"-x {name}: {name} is not set in poprun's environment, so there "
                            "is nothing to export")
    if args.launcher not in ("auto", "local", "mpirun"):
        raise UsageError(f"--launcher expects auto, local or mpirun, got '{args.launcher}'")
    remote = sorted({h for h in layout.hosts if not topo.is_local_host(h)})
    launcher = args.launcher
    if launcher == "auto":
        launcher = "mpirun" if remote else "local"
    if launcher == "local" and remote:
        raise UsageError(f"--launcher local cannot reach {', '.join(remote)}: remote hosts "
                         "need mpirun (--launcher auto or mpirun)")
    if launcher == "local":
        unsupported = global_args.passthrough + local_args.passthrough + [
            token for extra in instance_args.values() for token in extra.passthrough]
        unsupported = [t for t in unsupported if t not in ("--oversubscribe", "-oversubscribe")]
        if unsupported:
            raise UsageError(
                f"mpirun option(s) {' '.join(unsupported)} have no meaning for local instances "
                "(the local launcher understands --tag-output, --output-filename and -x); "
                "use --launcher mpirun to run through mpirun")
    program = [resolve_program(args.program[0]), *args.program[1:]]
    shared = shared_environment(args, layout, environ, log)
    return Plan(layout, source, program, global_args, local_args, instance_args, launcher,
                shared, args.termination_grace_period, only, args.numa_aware,
                args.allow_run_as_root or global_args.allow_run_as_root)


def shared_environment(args: CommandLine, layout: topo.Topology, environ: dict[str, str],
                       log: Log) -> dict[str, str]:
    """Variables poprun gives every instance besides the per-instance PopDist ones."""
    shared: dict[str, str] = {}
    if "PYTHONUNBUFFERED" not in environ:
        shared["PYTHONUNBUFFERED"] = "1"  # Python output reaches poprun as it is printed
    if args.executable_cache_path:
        cache = Path(args.executable_cache_path).absolute()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LaunchError(f"--executable-cache-path {cache}: {error.strerror}") from None
        if not os.access(cache, os.W_OK):
            raise LaunchError(f"--executable-cache-path {cache} is not writable")
        shared["POPTORCH_CACHE_DIR"] = str(cache)
        log.info(f"executable cache: {cache} (POPTORCH_CACHE_DIR)")
    if args.vipu_partition:
        shared.update({
            "IPUOF_VIPU_API_HOST": args.vipu_server_host,
            "IPUOF_VIPU_API_PORT": str(args.vipu_server_port),
            "IPUOF_VIPU_API_PARTITION_ID": args.vipu_partition,
            "IPUOF_VIPU_API_TIMEOUT": str(args.vipu_server_timeout),
        })
    first_host = layout.placement(0).host
    if all(topo.is_local_host(host) for host in layout.hosts):
        master_addr, port = "127.0.0.1", free_port("127.0.0.1")
    else:
        loopback_alias = first_host.lower() in ("localhost", "127.0.0.1", "::1")
        master_addr = socket.gethostname() if loopback_alias else first_host
        port = free_port("0.0.0.0")
    shared["MASTER_ADDR"], shared["MASTER_PORT"] = master_addr, str(port)
    return shared


def instance_environment(plan: Plan, index: int, environ: dict[str, str]) -> dict[str, str]:
    """Instance `index`'s variables on top of `environ` (what the program will see)."""
    layout = plan.topology
    env = dict(environ)
    env.update(plan.shared_env)
    env.update(layout.popdist_environment(index))
    env.update(layout.process_group_environment(
        index, plan.shared_env["MASTER_ADDR"], int(plan.shared_env["MASTER_PORT"])))
    if plan.launcher == "local":
        env.update(layout.mpi_environment(index))
    if "IPUOF_VIPU_API_PARTITION_ID" in plan.shared_env:
        env["IPUOF_VIPU_API_GCD_ID"] = str(layout.placement(index).ild)
    exports = plan.local_args.merge(plan.instance_args.get(index, LocalArgs())).exports
    env.update({name: value for name, value in exports.items() if value is not None})
    return env


def local_commands(plan: Plan, environ: dict[str, str], log: Log) -> list[InstanceCommand]:
    nodes = numa_nodes() if plan.numa_aware else []
    if plan.numa_aware and not nodes:
        log.warning("--numa-aware: this system reports no NUMA nodes; instances are not bound")
    allowed = os.sched_getaffinity(0) if nodes else set()
    commands = []
    for index in range(plan.topology.num_instances):
        place = plan.topology.placement(index)
        cpus = None
        if nodes:
            node = place.local_index % len(nodes)
            cpus = frozenset(nodes[node] & allowed) or None
            log.info(f"instance {index}: NUMA node {node}, CPUs {_ranges(sorted(cpus or []))}")
        env = instance_environment(plan, index, environ)
        commands.append(InstanceCommand(index, plan.program, env, cpus, stdin=index == 0))
        log.debug(f"instance {index} on {place.host}: " + " ".join(
            f"{k}={v}" for k, v in env.items() if k not in environ or environ[k] != v))
    return commands


def _ranges(numbers: list[int]) -> str:
    parts, start = [], None
    for position, number in enumerate(numbers):
        if start is None:
            start = number
        if position + 1 == len(numbers) or numbers[position + 1] != number + 1:
            parts.append(str(start) if start == number else f"{start}-{number}")
            start = None
    return ",".join(parts) or "none"


def mpirun_command(plan: Plan, mpirun: str, environ: dict[str, str]) -> list[str]:
    """The OpenMPI command line: global options, then one application context per instance."""
    layout = plan.topology
    slots: dict[str, int] = {}
    for index in range(layout.num_instances):
        host = layout.placement(index).host
        slots[host] = slots.get(host, 0) + 1
    rsh_args = " ".join(SSH_OPTIONS) + f" -o ConnectTimeout={SSH_CONNECT_TIMEOUT}"
    placement = ["--map-by", "numa", "--bind-to", "numa"] if plan.numa_aware \
        else ["--bind-to", "none"]
    command = [mpirun, *placement, "--mca", "plm_rsh_args", rsh_args]
    if plan.allow_run_as_root:
        command.append("--allow-run-as-root")
    command += plan.global_args.passthrough
    forwarded = [name for name in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")
                 if name in environ]
    wrapper = [sys.executable, "-m", "popdist._instance",
               "--grace", f"{plan.grace_seconds:g}"]
    if plan.global_args.tag_output:
        wrapper.append("--tag-output")
    if plan.global_args.output_filename:
        wrapper += ["--output-filename", plan.global_args.output_filename]
        if not plan.global_args.copy_to_terminal:
            wrapper.append("--nocopy")
    if plan.only_instance is not None:
        wrapper += ["--only-output-from-instance", str(plan.only_instance)]
    for index in range(layout.num_instances):
        host = layout.placement(index).host
        env = instance_environment(plan, index, environ)
        extra = plan.local_args.merge(plan.instance_args.get(index, LocalArgs()))
        context = ["-np", "1", "--host", f"{host}:{slots[host]}"]
        for name in forwarded:
            context += ["-x", name]
        names = dict.fromkeys([*plan.shared_env, *layout.popdist_environment(index),
                               *layout.process_group_environment(index, "", 0)])
        for name in names:
            context += ["-x", f"{name}={env[name]}"]
        if "IPUOF_VIPU_API_GCD_ID" in env:
            context += ["-x", f"IPUOF_VIPU_API_GCD_ID={env['IPUOF_VIPU_API_GCD_ID']}"]
        for name, value in extra.exports.items():
            context += ["-x", name if value is None else f"{name}={value}"]
        context += extra.passthrough
        context += [*wrapper, "--index", str(index), "--", *plan.program]
        if index:
            command.append(":")
        command += context
    return command


def launch_local(plan: Plan, environ: dict[str, str], log: Log) -> int:
    router = OutputRouter(tag_output=plan.global_args.tag_output,
                          only_instance=plan.only_instance,
                          output_dir=plan.global_args.output_filename,
                          copy_to_terminal=plan.global_args.copy_to_terminal)
    commands = local_commands(plan, environ, log)
    log.info(f"starting {len(commands)} local instance(s): {shlex.join(plan.program)}")
    supervisor = Supervisor(router, plan.grace_seconds, on_event=say)
    result = supervisor.run(commands)
    report(result, plan, router)
    return result.exit_status


def report(result: SupervisionResult, plan: Plan, router: OutputRouter) -> None:
    """Say how the run ended when it did not end well."""
    hosts = {i: plan.topology.placement(i).host for i in range(plan.topology.num_instances)}
    failure = result.first_failure
    if failure is not None:
        say(f"instance {failure.index} (pid {failure.pid} on {hosts[failure.index]}) failed "
            f"first: it {failure.describe()}")
        if not router.shows(failure.index) and router.tail(failure.index):
            say(f"last lines instance {failure.index} wrote to stderr:")
            for line in router.tail(failure.index):
                print(f"    {line}", file=sys.stderr)
    if result.interrupt is not None:
        say(f"interrupted by {signal_name(result.interrupt)}")
    stopped = [e for e in result.exits if e.signalled_by_launcher is not None]
    if stopped:
        say("stopped: " + "; ".join(
            f"instance {e.index} {e.describe()} (poprun sent "
            f"{signal_name(e.signalled_by_launcher)})"
            for e in stopped))


def launch_mpirun(plan: Plan, environ: dict[str, str], log: Log) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("mpirun not found: runs on other hosts go through OpenMPI's mpirun; "
                          "install it (Debian/Ubuntu: apt-get install openmpi-bin)")
    if os.geteuid() == 0 and not plan.allow_run_as_root and not (
            environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1"
            and environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"):
        raise LaunchError("mpirun refuses to run as root: pass --allow-run-as-root=yes, or set "
                          "OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
    remote = sorted({h for h in plan.topology.hosts if not topo.is_local_host(h)})
    if remote:
        log.info(f"checking non-interactive ssh to {', '.join(remote)}")
        errors = check_ssh(remote)
        if errors:
            raise LaunchError("cannot reach every host; nothing was started:\n  "
                              + "\n  ".join(errors))
    command = mpirun_command(plan, mpirun, environ)
    log.info(f"running command: {shlex.join(command)}")
    supervisor = Supervisor(OutputRouter(), plan.grace_seconds, on_event=say)
    result = supervisor.run([InstanceCommand(0, command, environ, capture_output=False,
                                             stdin=True, name="mpirun")])
    if result.interrupt is not None:
        say(f"interrupted by {signal_name(result.interrupt)}")
    return result.exit_status


def run(argv: list[str], environ: dict[str, str] | None = None) -> int:
    """poprun's whole life: parse, check, launch, report. Returns the exit status."""
    env = dict(os.environ if environ is None else environ)
    try:
        args = parse_command_line(argv)
        if args.help:
            sys.stdout.write(help_text())
            return 0
        if args.version:
            print(f"poprun {VERSION} (popdist, emulated IPUs)")
            return 0
        log = Log(args.verbose)
        plan = make_plan(args, env, log)
        log.info(f"hosts from {plan.hosts_source}: {', '.join(plan.topology.hosts)}")
        layout = plan.topology
        log.info(f"{layout.num_instances} instance(s) x {layout.replicas_per_instance} "
                 f"replica(s) x {layout.ipus_per_replica} IPU(s) per replica on "
                 f"{len(layout.hosts)} host(s) and {layout.num_ilds} ILD(s); launcher: "
                 f"{plan.launcher}")
        log.info(vipu_report(args))
        if args.print_topology:
            print(layout.table(), flush=True)
        if plan.launcher == "local":
            return launch_local(plan, env, log)
        return launch_mpirun(plan, env, log)
    except UsageError as error:
        print(f"poprun: error: {error}", file=sys.stderr)
        print("Try 'poprun --help' for the options.", file=sys.stderr)
        return ERROR_STATUS
    except LaunchError as error:
        print(f"poprun: error: {error}", file=sys.stderr)
        return LAUNCH_ERROR_STATUS
    except OSError as error:
        print(f"poprun: error: cannot start the instances: {error}", file=sys.stderr)
        return LAUNCH_ERROR_STATUS


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

"""poprun's command line: the option table, its parser, `--help`, and the mpirun argument
strings (--mpi-global-args, --mpi-local-args, --instance-mpi-local-args).

Options follow PopRun's conventions: `--name value` or `--name=value`; boolean options take
yes/no, 1/0, true/false or nothing (meaning yes); options end at the first word that is not an
option (the program), or at `--`.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

USAGE = "poprun [options] program [program args]"


class UsageError(Exception):
    """A problem with the command line, found before anything started."""


@dataclass(frozen=True)
class Option:
    """One command-line option: its names, value kind, default and help text."""

    names: tuple[str, ...]
    dest: str
    kind: str  # flag, count, bool, int, port, float, str, append
    help: str
    default: Any = None
    group: str = "Configuration"
    metavar: str = "arg"

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("flag", "count", "bool")


OPTIONS = (
    Option(("-h", "--help"), "help", "flag", "Print this table of options and exit.",
           False, "Generic"),
    Option(("--version",), "version", "flag", "Print the version and exit.", False, "Generic"),
    Option(("-H", "--host"), "host", "str",
           "Hosts to run the instances on, comma-separated, with ranges as in host[0-2,4]; "
           "the instances are divided evenly among them. Default: the hosts of the Slurm "
           "allocation (SLURM_JOB_NODELIST), else this machine.", None, metavar="hosts"),
    Option(("--num-replicas",), "num_replicas", "int",
           "Total number of replicas, divided evenly among the instances.", 1, metavar="N"),
    Option(("--ipus-per-replica",), "ipus_per_replica", "int",
           "Number of IPUs each replica uses.", 1, metavar="N"),
    Option(("--num-instances",), "num_instances", "int",
           "Number of instances (processes) to launch.", 1, metavar="N"),
    Option(("--num-ilds",), "num_ilds", "int",
           "Number of IPU-Link domains; each holds the same number of instances.", 1,
           metavar="N"),
    Option(("--executable-cache-path",), "executable_cache_path", "str",
           "Directory for compiled executables, shared by the instances (exported as "
           "POPTORCH_CACHE_DIR).", None, metavar="dir"),
    Option(("--offline-mode",), "offline_mode", "bool",
           "Run without requiring or attaching to IPUs (always true of emulated IPUs).", False),
    Option(("--numa-aware",), "numa_aware", "bool",
           "Bind the instances of each host to its NUMA nodes, round robin.", False),
    Option(("--vipu-server-host",), "vipu_server_host", "str",
           "Host of the V-IPU server.", "localhost", "V-IPU", "host"),
    Option(("--vipu-server-port",), "vipu_server_port", "port",
           "Port of the V-IPU server.", 8090, "V-IPU", "port"),
    Option(("--vipu-server-timeout",), "vipu_server_timeout", "int",
           "Timeout of V-IPU server requests, in seconds.", 120, "V-IPU", "seconds"),
    Option(("--vipu-partition",), "vipu_partition", "str",
           "V-IPU partition to create or use.", None, "V-IPU", "name"),
    Option(("--vipu-partition-attempts",), "vipu_partition_attempts", "int",
           "Attempts to bind to the partition until it is ACTIVE.", 1, "V-IPU", "N"),
    Option(("--vipu-allocation",), "vipu_allocation", "str",
           "V-IPU allocation to create the partition in.", None, "V-IPU", "name"),
    Option(("--vipu-cluster",), "vipu_cluster", "str",
           "V-IPU cluster to create the partition in (deprecated: use --vipu-allocation).",
           None, "V-IPU", "name"),
    Option(("--update-partition",), "update_partition", "bool",
           "Update the V-IPU partition if it does not match the job.", False, "V-IPU"),
    Option(("--reset-partition",), "reset_partition", "bool",
           "Reset the V-IPU partition before the run.", None, "V-IPU"),
    Option(("--remove-partition",), "remove_partition", "bool",
           "Remove the V-IPU partition poprun created once the run ends.", True, "V-IPU"),
    Option(("--mpi-global-args",), "mpi_global_args", "append",
           "Options for mpirun as a whole, e.g. \"--tag-output --output-filename DIR\" "
           "(may be repeated).", None, "MPI", "args"),
    Option(("--mpi-local-args",), "mpi_local_args", "append",
           "Options for every instance, e.g. \"-x VAR -x VAR=VALUE\" (may be repeated; "
           "the -x lists are merged).", None, "MPI", "args"),
    Option(("--instance-mpi-local-args",), "instance_mpi_local_args", "append",
           "Options for one instance, as INDEX:ARGS, e.g. \"1:-x SEED=7\" (may be repeated).",
           None, "MPI", "index:args"),
    Option(("--allow-run-as-root",), "allow_run_as_root", "bool",
           "Let mpirun run as root.", False, "MPI"),
    Option(("--launcher",), "launcher", "str",
           "How to start the instances: local (child processes of poprun), mpirun, or auto "
           "(mpirun when a host is not this machine).", "auto", "Launch", "auto|local|mpirun"),
    Option(("--termination-grace-period",), "termination_grace_period", "float",
           "Seconds the instances get to exit after SIGTERM (or a forwarded signal) before "
           "SIGKILL.", 5.0, "Launch", "seconds"),
    Option(("--print-topology",), "print_topology", "bool",
           "Print the table of hosts, ILDs, instances, replicas and IPUs.", False, "Output"),
    Option(("--only-output-from-instance",), "only_output_from_instance", "int0",
           "Show only this instance's output (the others' is hidden, so a failing instance's "
           "last stderr lines are printed when it fails).", None, "Output", "index"),
    Option(("-v", "--verbose"), "verbose", "count", "Verbose output.", 0, "Debug"),
    Option(("--vv",), "very_verbose", "flag",
           "Very verbose output (every instance's environment and command).", False, "Debug"),
)
_BY_NAME = {name: option for option in OPTIONS for name in option.names}
_TRUE = ("1", "yes", "true", "on")
_FALSE = ("0", "no", "false", "off")


@dataclass
class CommandLine:
    """The parsed command line: option values by `Option.dest`, and the program to run."""

    values: dict[str, Any]
    program: list[str]

    def __getattr__(self, name: str) -> Any:
        if name == "values":
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def parse_command_line(argv: list[str]) -> CommandLine:
    """Parse `argv` (without the command name). Options end at the first non-option word."""
    values = {option.dest: option.default for option in OPTIONS}
    for option in OPTIONS:
        if option.kind == "append":
            values[option.dest] = []
    position = 0
    while position < len(argv):
        word = argv[position]
        if word == "--":
            position += 1
            break
        if not word.startswith("-") or word == "-":
            break
        name, has_inline, inline = word.partition("=") if word.startswith("--") \
            else (word, "", "")
        if name not in _BY_NAME and name.startswith("-") and not name.startswith("--") \
                and name[:2] in _BY_NAME and _BY_NAME[name[:2]].takes_value:
            name, has_inline, inline = name[:2], "=", name[2:]  # -Hhost
        option = _BY_NAME.get(name)
        if option is None:
            raise UsageError(f"unknown option '{name}'{_suggestion(name)}")
        position += 1
        if option.kind == "flag":
            if has_inline:
                raise UsageError(f"option '{name}' takes no value")
            values[option.dest] = True
        elif option.kind == "count":
            values[option.dest] += 1
        elif option.kind == "bool":
            if has_inline:
                values[option.dest] = _parse_bool(name, inline)
            elif position < len(argv) and argv[position].lower() in _TRUE + _FALSE:
                values[option.dest] = _parse_bool(name, argv[position])
                position += 1
            else:
                values[option.dest] = True
        else:
            if has_inline:
                raw = inline
            elif position < len(argv):
                raw = argv[position]
                position += 1
            else:
                raise UsageError(f"option '{name}' needs a value ({option.metavar})")
            value = _convert(option, name, raw)
            if option.kind == "append":
                values[option.dest].append(value)
            else:
                values[option.dest] = value
    if values.pop("very_verbose"):
        values["verbose"] = max(values["verbose"], 2)
    return CommandLine(values, list(argv[position:]))


def _suggestion(name: str) -> str:
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else "; see 'poprun --help'"


def _parse_bool(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise UsageError(f"option '{name}' expects yes or no (or 1/0, true/false), got '{raw}'")


def _convert(option: Option, name: str, raw: str) -> Any:
    if option.kind in ("str", "append"):
        if not raw.strip():
            raise UsageError(f"option '{name}' needs a non-empty value ({option.metavar})")
        return raw
    try:
        number = float(raw) if option.kind == "float" else int(raw)
    except ValueError:
        number = None
    checks = {
        "int": (lambda n: n >= 1, "a positive integer"),
        "int0": (lambda n: n >= 0, "a non-negative integer"),
        "port": (lambda n: 1 <= n <= 65535, "a port number (1-65535)"),
        "float": (lambda n: n >= 0, "a non-negative number of seconds"),
    }
    valid, description = checks[option.kind]
    if number is None or not valid(number):
        raise UsageError(f"option '{name}' expects {description}, got '{raw}'")
    return number


def help_text() -> str:
    """The option table `poprun --help` prints."""
    rows: list[tuple[str, str, str]] = []
    for option in OPTIONS:
        names = ", ".join(option.names)
        if option.takes_value:
            names += f" {option.metavar}"
        elif option.kind == "bool":
            names += " [yes|no]"
        description = option.help
        if option.default is not None and option.kind not in ("flag", "count", "append"):
            if option.kind == "bool":
                default = "yes" if option.default else "no"
            elif isinstance(option.default, float):
                default = f"{option.default:g}"
            else:
                default = str(option.default)
            description += f" [default: {default}]"
        rows.append((option.group, names, description))
    name_width = max(len(names) for _, names, _ in rows) + 2
    lines = [f"Usage: {USAGE}", "",
             "Launches `program` as several PopDist instances (see --num-instances)."]
    group = None
    for row_group, names, description in rows:
        if row_group != group:
            group = row_group
            lines += ["", f"{group} options:"]
        wrapped = _wrap(description, 96 - name_width)
        lines.append(f"  {names.ljust(name_width)}{wrapped[0]}")
        lines += [f"  {'':{name_width}}{more}" for more in wrapped[1:]]
    lines += ["", "Boolean options take yes/no, 1/0 or true/false; alone they mean yes.",
              "Exit status: 0 on success; the first failing instance's status (128 + signal",
              "number when it was killed by a signal); 128 + signal when poprun is interrupted;",
              "2 for usage errors; 1 when the job cannot start (unreachable host, no mpirun)."]
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    lines, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return lines + [current]


@dataclass
class GlobalArgs:
    """What --mpi-global-args asks for: output handling poprun implements, and the rest."""

    tag_output: bool = False
    output_filename: str | None = None
    copy_to_terminal: bool = True
    allow_run_as_root: bool = False
    passthrough: list[str] = field(default_factory=list)


def parse_global_args(strings: list[str]) -> GlobalArgs:
    parsed = GlobalArgs()
    tokens = [token for text in strings for token in _split(text, "--mpi-global-args")]
    position = 0
    while position < len(tokens):
        token = tokens[position]
        position += 1
        name, has_inline, inline = token.partition("=")
        name = "--" + name.lstrip("-") if name.startswith("-") else name
        if name == "--tag-output":
            parsed.tag_output = True
        elif name == "--output-filename":
            if not has_inline:
                if position >= len(tokens):
                    raise UsageError("--output-filename in --mpi-global-args needs a directory")
                inline = tokens[position]
                position += 1
            directory, _, modifier = inline.partition(":")
            if modifier not in ("", "nocopy"):
                raise UsageError(f"unknown --output-filename modifier ':{modifier}' "
                                 "(only ':nocopy' exists)")
            parsed.output_filename = os.path.abspath(directory)
            parsed.copy_to_terminal = modifier != "nocopy"
        elif name == "--allow-run-as-root":
            parsed.allow_run_as_root = True
        else:
            parsed.passthrough.append(token)
    return parsed


@dataclass
class LocalArgs:
    """What --mpi-local-args asks for: exported variables (-x) and other mpirun options."""

    exports: dict[str, str | None] = field(default_factory=dict)  # None: take poprun's value
    passthrough: list[str] = field(default_factory=list)

    def merge(self, other: "LocalArgs") -> "LocalArgs":
        return LocalArgs({**self.exports, **other.exports}, self.passthrough + other.passthrough)


def parse_local_args(strings: list[str], what: str = "--mpi-local-args") -> LocalArgs:
    parsed = LocalArgs()
    tokens = [token for text in strings for token in _split(text, what)]
    position = 0
    while position < len(tokens):
        token = tokens[position]
        position += 1
        if token == "-x":
            if position >= len(tokens):
                raise UsageError(f"'-x' at the end of {what} needs VAR or VAR=VALUE")
            token = tokens[position]
            position += 1
            name, has_value, value = token.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise UsageError(f"'-x {token}' in {what}: '{name}' is not a variable name")
            parsed.exports[name] = value if has_value else None
        else:
            parsed.passthrough.append(token)
    return parsed


def parse_instance_local_args(strings: list[str], num_instances: int) -> dict[int, LocalArgs]:
    per_instance: dict[int, LocalArgs] = {}
    for text in strings:
        index_text, colon, args = text.partition(":")
        if not colon or not index_text.strip().isdigit():
            raise UsageError(f"--instance-mpi-local-args expects INDEX:ARGS such as "
                             f"'1:-x SEED=7', got '{text}'")
        index = int(index_text)
        if index >= num_instances:
            raise UsageError(f"--instance-mpi-local-args names instance {index}, but there are "
                             f"only {num_instances} instances (0..{num_instances - 1})")
        parsed = parse_local_args([args], f"--instance-mpi-local-args {index}:...")
        per_instance[index] = per_instance.get(index, LocalArgs()).merge(parsed)
    return per_instance


def _split(text: str, what: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:
        raise UsageError(f"cannot split {what} '{text}': {error}") from None

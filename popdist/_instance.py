"""The per-instance side of an mpirun launch: `python -m popdist._instance [options] -- program`.

poprun gives every mpirun application context this wrapper, so an instance on a remote host
gets the output handling of a local run (segments cut at \\r and \\n, tags, per-rank files,
--only-output-from-instance), and its process group is ended as a whole. The wrapper exits as
the program did: with its exit code, or by the same signal, which mpirun then reports.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from popdist.output import OutputRouter
from popdist.supervisor import InstanceCommand, Supervisor


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m popdist._instance")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--tag-output", action="store_true")
    parser.add_argument("--output-filename")
    parser.add_argument("--nocopy", action="store_true")
    parser.add_argument("--only-output-from-instance", type=int)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        parser.error("no program given")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if rank is not None and int(rank) != args.index:
        print(f"poprun: instance {args.index} started as MPI rank {rank}: mpirun placed the "
              "application contexts out of order", file=sys.stderr)
        return 1
    router = OutputRouter(tag_output=args.tag_output,
                          only_instance=args.only_output_from_instance,
                          output_dir=args.output_filename, copy_to_terminal=not args.nocopy)

    def event(message: str) -> None:
        print(f"poprun: instance {args.index} on {socket.gethostname()}: {message}",
              file=sys.stderr, flush=True)

    supervisor = Supervisor(router, args.grace, on_event=event)
    command = InstanceCommand(args.index, args.program, dict(os.environ),
                              stdin=args.index == 0, name="the program")
    try:
        result = supervisor.run([command])
    except OSError as error:
        event(f"cannot start {args.program[0]}: {error.strerror or error}")
        return 127
    (exit,) = result.exits
    if exit.failed:
        if not router.shows(args.index):
            for line in router.tail(args.index):
                print(f"    {line}", file=sys.stderr)
    if exit.returncode < 0:
        signum = -exit.returncode
        sys.stdout.flush()
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return exit.shell_status


if __name__ == "__main__":
    sys.exit(main())

"""Command-line entry points run in the test's own process, for tests whose claim is about what a command does,
not about it being a separate process (those keep their subprocesses: signals, locks, runs side by side, launchers,
the allocator's re-execution, faults injected at start-up). A process would add only its start-up: Python, torch
and torch's compiler stack imported again, seconds a command.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

# What the tests' subprocesses get besides the caller's environment: no progress lines among what they print.
ENV = {"PCAF_NO_PROGRESS": "1"}


@dataclass
class Result:
    """What :func:`subprocess.run` would have returned: the exit status and what the command printed."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _as_a_command(argv: list[str], env: dict[str, str]):
    """``sys.argv`` and the environment as the command's, stdout and stderr captured; afterwards the process as it
    was: environment, logging (Hydra configures it for its jobs) and Hydra's global state (its main initialises
    it and sets the job's config)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level, argv_before = root.handlers[:], root.level, sys.argv
    # logging.config.dictConfig, which Hydra calls, closes every handler the process has, and some close their
    # stream (absl's, which JAX imports, writes to the sys.stderr of when it was made: pytest's capture). A
    # command's own process has no handlers of this one's: Hydra's configuration sees none of them.
    live, named = logging._handlerList[:], dict(logging._handlers)
    logging._handlerList[:] = []
    env_before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        sys.argv = argv_before
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        root.handlers[:] = handlers
        root.setLevel(level)
        logging._handlerList[:] = live
        logging._handlers.clear()
        logging._handlers.update(named)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def run_main(main: Callable[..., int | None], argv: list[str], **env: str) -> Result:
    """``python -m <module> ARGV`` of a module whose ``__main__`` block is ``sys.exit(main())`` (a ``main`` that
    takes no ``argv`` reads ``sys.argv``)."""
    module = sys.modules[main.__module__]
    with _as_a_command([module.__file__, *argv], {**ENV, **env}) as (out, err):
        try:
            code = (main(list(argv)) if inspect.signature(main).parameters else main()) or 0
        except SystemExit as exc:
            code = _exit_status(exc)
    return Result(code, out.getvalue(), err.getvalue())


def run_app(argv: list[str], **env: str) -> Result:
    """``python -m experiments.run ARGV``: what its ``__main__`` block does (every job checked before Hydra starts,
    then Hydra's main). The allocator's re-execution is left out: these tests set its tunables as the Makefile
    does, under which the command does not re-execute either."""
    from experiments import run
    from experiments.preflight import check_command_line

    # Hydra looks for the config directory beside the file of a ``__main__`` module (``python -m``), else in the
    # module's package, which ``experiments/conf`` is not: this main is run as ``python -m`` runs it.
    task = inspect.unwrap(run.main)
    with _as_a_command([run.__file__, *argv], {**ENV, **env}) as (out, err):
        task.__module__ = "__main__"
        try:
            code = check_command_line(list(argv))
            if code is None:
                run.main()
                code = 0
        except SystemExit as exc:
            code = _exit_status(exc)
        finally:
            task.__module__ = run.__name__
    return Result(code, out.getvalue(), err.getvalue())

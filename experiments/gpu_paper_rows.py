"""Paper-scale rows on a GPU machine: step costs, the rows themselves, and their run records to take home.

    python3 -m experiments.gpu_paper_rows --make-site          # here, once: .gpu_site/ from this environment
    python3 -m experiments.gpu_paper_rows --unpack records.tar.gz [--into docs/results/runs]   # here, after
    python3 -m experiments.gpu_paper_rows --unpack-cache compile_cache.tar.gz                  # here, after
    python3 -m experiments.gpu_paper_rows [--step-cost wt2-nt-1024,wt2-nt-2048] [--out DIR] [--budget-s S]
                                          [--scale paper] [--device cuda] [--override KEY=VALUE ...]
                                          [--stop-on-failure] [--compile-cache DIR]
                                          [--gpu-tests K_EXPR [--try-override KEY=VALUE --try-if-passed NAME]]
                                          TABLE/ROW ...

On the GPU machine (docs/EXPERIMENTS.md, "Paper rows on a GPU"), in order:

0. with ``--gpu-tests K_EXPR``, the ``gpu`` tests that ``-k K_EXPR`` selects (``make test-gpu``; the log and a JUnit
   report in ``<out>/gpu_tests.{log,xml}``, stopped after ``--gpu-tests-timeout``; :mod:`experiments.gpu_test_gate`).
   Their outcome stops nothing, but ``--try-if-passed NAME`` uses the ``--try-override`` settings for a row only
   where every test whose id contains ``NAME`` passed (at least one); ``{row}`` in ``NAME`` is the row's name, so
   that a test's case for a model gates that model's rows;
1. ``make step-cost TABLE=<t> SCALE=<scale>`` for each table of ``--step-cost`` (default: the tables of the rows
   given, else wt2-nt-1024 and wt2-nt-2048; none: ``--step-cost ''``), timing only the rows given of that table
   (every row of a table none of whose rows is given), with
   ``--device`` and ``data.layout=tokens``; the per-row costs go to ``<out>/step_cost/<t>.csv`` and the log;
2. each ``TABLE/ROW`` in turn: ``python -m experiments.reproduce --table <t> --scale <scale> --backend <b>
   --rows <row> --no-render backend.device=<device> data.layout=tokens`` (the raw WikiText-2 release is not
   offline; the tokenized one stands in, which every record lists as a deviation), its runs under
   ``--output-root``;
3. after each row, its completed runs' records (``config.yaml``, ``environment.json``, ``metrics.json``,
   ``curve.csv``; no checkpoints) to ``<out>/runs/<t>/<scale>/<b>/<row>/<run>/``, and every record under
   ``<out>/runs`` packed again into the one archive ``<out>/records.tar.gz``, so a row finished before the
   machine goes away is already out, as one small file to copy back (a remote machine may hand back only a
   few files, or only shallow paths).

Back here, ``--unpack <out>/records.tar.gz --into docs/results/runs`` puts the records where the tables read
them: only record files at ``<table>/<scale>/<torch|jax>/<row>/<run>/`` are accepted, and a record that already
exists with other contents is refused, not overwritten.

``--try-override KEY=VALUE``: a setting that cannot change a row's numbers (a field of
:data:`pcaf_core.run_identity.NON_RESULT_FIELDS`, such as ``train.compile=cudagraphs``) with which each row is run
first; where that run fails, the row is run again without it, as a new run (``--fresh``). The step costs are timed
without it.

``--stop-on-failure``: once a row fails (its command exits non-zero, or leaves no completed run), the rows after
it are not started; the line saying so names them.

A machine reached through commands shorter than the rows runs this module under :mod:`experiments.detached`
(``start --out <out> -- python3 -m experiments.gpu_paper_rows --out <out> ...``), and each command takes home what
it has written so far with ``collect --out <out> --dest DEST --wait-s S``.

``--compile-cache DIR`` (default ``.compile_cache/``, ignored by git): the compilers' caches of every step are kept
there (:data:`CACHE_VARIABLES`: inductor's graphs and kernels, Triton's, XLA's executables; a variable already set
is kept) and packed with each row into ``<out>/compile_cache.tar.gz``. A machine that starts bare each time then
compiles a row's step once: ``--unpack-cache <archive>`` here puts the caches back into ``DIR``, and the next run
sends ``DIR`` along. A cache made by another compiler or for another GPU is simply not used (the compilers key
their entries on both); ``--compile-cache ''`` keeps the compilers' own defaults.

``--budget-s``: a row whose run predicted by step 1 (``wall_s``: its first step, training and evaluation; process
start-up not included) exceeds the seconds left is skipped, with a line saying so. The tables render here, from the
records alone: ``python -m experiments.paper_results`` (``make paper-results``) runs ``python -m paper_tables
render`` with :func:`trained_overrides` for every table and backend that has records, and ``paper_tables backends``
for torch and JAX side by side.

``--backend jax`` runs the rows on the JAX backend (``--device gpu``, JAX's name for a CUDA device, is then the
default): the same settings, for the cross-backend comparison at the paper's scale.

The GPU machine has torch but not Hydra: ``--make-site`` copies Hydra, OmegaConf and the antlr4 runtime (pure
Python) from this environment into the ignored ``.gpu_site/``, which the steps put on ``PYTHONPATH`` when it
exists. This module needs the standard library only, so it runs there before that path is set.
``--device cpu --scale smoke`` is the CPU dry run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from experiments import gpu_test_gate as gate
from experiments.detached import write_tar
from pcaf_core.results import SCALES  # the standard library only, as this module needs
from pcaf_core.run_identity import NON_RESULT_FIELDS  # the standard library too

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / ".gpu_site"
SITE_PACKAGES = (("hydra", "hydra_core"), ("omegaconf", "omegaconf"), ("antlr4", "antlr4_python3_runtime"))
"""(module, distribution name in its ``.dist-info``) of each pure-Python package ``.gpu_site`` holds."""
RECORD_FILES = ("config.yaml", "environment.json", "metrics.json", "curve.csv")
"""What a run record is made of: no checkpoints."""
PAPER_TABLES = ("wt2-nt-1024", "wt2-nt-2048")
BACKENDS = ("torch", "jax")
ACCELERATOR = {"torch": "cuda", "jax": "gpu"}
"""Each backend's name for the CUDA device (``backend.device``)."""
DATA_OVERRIDE = "data.layout=tokens"
"""The one deviation of the paper rows' data: the raw WikiText-2 release is not available offline, the tokenized one
stands in."""


def trained_overrides(backend: str) -> list[str]:
    """The Hydra overrides this module trains a paper row of ``backend`` with on the GPU, and that a table must be
    rendered with to take the records it brings back for the rows: ``backend.device=<the GPU's name>`` and
    :data:`DATA_OVERRIDE`."""
    return [f"backend.device={ACCELERATOR[backend]}", DATA_OVERRIDE]


def make_site(dest: Path = SITE) -> list[str]:
    """Copy :data:`SITE_PACKAGES` (and their ``.dist-info``, which version lookups read) from this interpreter's
    environment into ``dest``, replacing what was there; returns what was copied."""
    import importlib

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    copied = []
    for module, dist in SITE_PACKAGES:
        src = Path(importlib.import_module(module).__file__).parent
        shutil.copytree(src, dest / module, ignore=shutil.ignore_patterns("__pycache__"))
        infos = sorted(src.parent.glob(f"{dist}-*.dist-info"))
        for info in infos:
            shutil.copytree(info, dest / info.name)
        copied += [module, *(i.name for i in infos)]
    return copied


STEP_PACKAGES = ("hydra", "omegaconf", "yaml")
"""What every step cost and row imports beyond torch, JAX and numpy: :data:`SITE_PACKAGES` and PyYAML, which
OmegaConf needs and the GPU image has."""


def missing_packages(python: str, env: dict[str, str]) -> list[str]:
    """The :data:`STEP_PACKAGES` that ``python`` cannot import in ``env`` (one interpreter start, well under a
    second)."""
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    done = subprocess.run([python, "-c", probe, *STEP_PACKAGES], env=env, cwd=REPO, capture_output=True, text=True)
    return done.stdout.split() if done.returncode == 0 else list(STEP_PACKAGES)


def child_env() -> dict[str, str]:
    """The environment of every step: ``.gpu_site`` (when it exists) and the repository first on ``PYTHONPATH``."""
    env = dict(os.environ)
    paths = [str(SITE)] if SITE.is_dir() else []
    paths += [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


CACHE_DIR = REPO / ".compile_cache"
CACHE_ARCHIVE = "compile_cache.tar.gz"
CACHE_VARIABLES = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                   ("JAX_COMPILATION_CACHE_DIR", "jax"))
"""(environment variable, folder under ``--compile-cache``) of each compiler cache the steps keep: inductor's FX
graphs, autotuning and generated kernels; Triton's compiled kernels (the project's own and inductor's); XLA's
executables (JAX's persistent compilation cache)."""


def cache_env(env: dict[str, str], cache_dir: Path) -> dict[str, str]:
    """``env`` with each :data:`CACHE_VARIABLES` variable that is not set already pointing into ``cache_dir``."""
    for variable, folder in CACHE_VARIABLES:
        env.setdefault(variable, str(cache_dir / folder))
    return env


def pack_cache(cache_dir: Path, archive: Path) -> tuple[int, int]:
    """Every file under ``cache_dir`` into ``archive`` (atomically); returns (files, bytes of the archive)."""
    files = sorted(p for p in cache_dir.rglob("*") if p.is_file() and not p.is_symlink())
    write_tar(files, cache_dir, archive)
    return len(files), archive.stat().st_size


def unpack_cache(archive: Path, cache_dir: Path) -> int:
    """The files of a :func:`pack_cache` archive extracted into ``cache_dir`` (over what is there: a cache entry
    is named by its key); returns their number. A member outside the folder or not a plain file or folder is
    refused by tarfile's ``data`` filter, with nothing written after it."""
    if not archive.is_file():
        raise SystemExit(f"no archive at {archive}: give the {CACHE_ARCHIVE} a GPU run wrote to its --out folder")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tar.extractall(cache_dir, members=members, filter="data")
    return len(members)


def report_cache(cache_dir: Path | None, out: Path) -> None:
    """:func:`pack_cache` of ``cache_dir`` (when there is one) into ``out``, with a line saying what it holds."""
    if cache_dir is not None and cache_dir.is_dir():
        files, size = pack_cache(cache_dir, out / CACHE_ARCHIVE)
        print(f"[gpu_paper_rows] {out / CACHE_ARCHIVE}: {files} file(s), {size / 2**20:.1f} MiB", flush=True)


def step_cost_command(table: str, scale: str, device: str, csv_path: Path, python: str,
                      backend: str = "torch", rows: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> list[str]:
    """``make step-cost`` for ``table`` (``rows``: only those rows; none: every row) with this interpreter (no
    virtualenv or data target is remade: the GPU machine has no ``.venv`` and prepares data on first use);
    ``python -m experiments.step_cost`` without make. ``extra``: Hydra overrides after ``data.layout=tokens``."""
    overrides = " ".join((f"--device {device} --csv {csv_path} {DATA_OVERRIDE}", *extra))
    globs = ",".join(rows) or "*"
    if shutil.which("make"):
        return ["make", "-o", ".venv/.installed", "-o", "data", "step-cost", f"PY={python}", f"TABLE={table}",
                f"SCALE={scale}", f"BACKEND={backend}", f"ROWS={globs}", f"OVERRIDES={overrides}"]
    return [python, "-m", "experiments.step_cost", "--table", table, "--scale", scale, "--backend", backend,
            "--rows", globs, *overrides.split()]


def reproduce_command(table: str, row: str, scale: str, device: str, output_root: Path, python: str,
                      backend: str = "torch", extra: tuple[str, ...] = (), fresh: bool = False) -> list[str]:
    """``extra``: Hydra overrides after ``data.layout=tokens`` (the same as the step cost's); ``fresh``: a new run
    whatever runs of the row ``output_root`` holds (``--fresh``)."""
    return [python, "-m", "experiments.reproduce", "--table", table, "--scale", scale, "--backend", backend,
            "--rows", row, "--output-root", str(output_root), "--no-render", *(["--fresh"] if fresh else []),
            f"backend.device={device}", DATA_OVERRIDE, *extra]


def copy_records(output_root: Path, table: str, scale: str, row: str, dest_root: Path,
                 backend: str = "torch") -> list[Path]:
    """The :data:`RECORD_FILES` of every completed run of ``row`` under ``output_root`` copied to
    ``dest_root/<table>/<scale>/<backend>/<row>/<run>/``, the copies' paths under this checkout made relative to it
    (:func:`pcaf_core.record_relocate.relocate_record`: a record committed elsewhere names no folder of this
    machine); returns the destination folders."""
    from pcaf_core.record_relocate import relocate_record  # numpy: after the standard-library start

    copied = []
    for metrics in sorted((output_root / table / scale / backend / row).glob("*/metrics.json")):
        try:
            status = json.loads(metrics.read_text()).get("status")
        except (OSError, ValueError):
            continue
        if status != "completed":
            continue
        dest = dest_root / table / scale / backend / row / metrics.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in RECORD_FILES:
            if (metrics.parent / name).exists():
                shutil.copy2(metrics.parent / name, dest / name)
        relocate_record(dest, REPO)
        copied.append(dest)
    return copied


ARCHIVE_NAME = "records.tar.gz"


def pack_records(runs_root: Path, archive: Path) -> int:
    """Every :data:`RECORD_FILES` file under ``runs_root`` (paths relative to it) into the gzipped tar
    ``archive``, written atomically (a temporary file renamed over it); returns the number of files."""
    files = sorted(p for p in runs_root.rglob("*") if p.is_file() and p.name in RECORD_FILES)
    write_tar(files, runs_root, archive)
    return len(files)


def unpack_records(archive: Path, into: Path) -> list[Path]:
    """The run records of ``archive`` (from :func:`pack_records`) extracted under ``into``; returns the run
    folders. Raises ``SystemExit`` with one line, before anything is written, for a member that is not a record
    file at ``<table>/<scale>/<torch|jax>/<row>/<run>/<file>`` and for a record that exists under ``into`` with other
    contents."""
    if not archive.is_file():
        raise SystemExit(f"no archive at {archive}: give the records.tar.gz a GPU run wrote to its --out folder")
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if (not m.isfile() or len(parts) != 6 or parts[2] not in BACKENDS or parts[5] not in RECORD_FILES
                    or any(p in ("", ".", "..") for p in parts) or Path(m.name).is_absolute()):
                raise SystemExit(f"{archive}: {m.name!r} is not a run record file "
                                 f"(<table>/<scale>/<{'|'.join(BACKENDS)}>/<row>/<run>/<{'|'.join(RECORD_FILES)}>): "
                                 "nothing unpacked")
            dest = into / m.name
            if dest.exists() and dest.read_bytes() != tar.extractfile(m).read():
                raise SystemExit(f"{dest} exists with other contents: move it away to unpack {archive} "
                                 "(nothing unpacked)")
        tar.extractall(into, members=members, filter="data")
    return sorted({(into / m.name).parent for m in members})


def predicted_seconds(out: Path, backend: str = "torch") -> dict[tuple[str, str], float]:
    """``{(table, row): seconds}`` of ``backend`` from the step-cost CSVs under ``out/step_cost``: the whole run
    (``wall_s``: first step, training and evaluation), or its training alone (``train_s``) in a CSV from before
    ``experiments.step_cost`` predicted whole runs."""
    costs = {}
    for path in sorted((out / "step_cost").glob("*.csv")):
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                if r.get("backend", "torch") == backend:
                    costs[(r["table"], r["row"])] = float(r.get("wall_s") or r["train_s"])
    return costs


def parse_rows(items: list[str]) -> list[tuple[str, str]]:
    rows = []
    for item in items:
        table, sep, row = item.partition("/")
        if not sep or not table or not row or "/" in row:
            raise SystemExit(f"row {item!r} is not TABLE/ROW: name rows like wt2-nt-2048/transformer_local")
        rows.append((table, row))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="*", help="TABLE/ROW to train, in this order")
    parser.add_argument("--make-site", action="store_true", help=f"write {SITE.name}/ from this environment and stop")
    parser.add_argument("--unpack", metavar="ARCHIVE", help=f"extract the run records of a {ARCHIVE_NAME} into "
                        "--into and stop")
    parser.add_argument("--into", default="docs/results/runs", help="where --unpack puts the records")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help=f"where the steps keep the compilers' caches (default: {CACHE_DIR.name}/ in the "
                        f"checkout), packed into <out>/{CACHE_ARCHIVE} after each row ('' for the compilers' "
                        "defaults)")
    parser.add_argument("--unpack-cache", metavar="ARCHIVE", help=f"extract a {CACHE_ARCHIVE} into --compile-cache "
                        "and stop")
    parser.add_argument("--step-cost", default=None, help="tables to time first, comma-separated ('' for none; "
                        f"default: the tables of the rows given, or {','.join(PAPER_TABLES)} when none is)")
    parser.add_argument("--scale", default="paper", choices=SCALES)
    parser.add_argument("--backend", default="torch", choices=BACKENDS)
    parser.add_argument("--device", default="", help="the backend's CUDA device (torch: cuda, JAX: gpu; the "
                        "default) or cpu (a dry run, with --scale smoke)")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_out"), help="where records and logs go "
                        "(default: $OUT, the folder the GPU machine sends back)")
    parser.add_argument("--output-root", default="outputs/gpu", help="the runs themselves, checkpoints included")
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip rows predicted to train longer than the "
                        "seconds left (0: no budget)")
    parser.add_argument("--stop-on-failure", action="store_true", help="train no further row once one fails (e.g. "
                        "a first try of --override train.compile=on: the next command then trains the rest otherwise)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every step cost and row, e.g. train.compile=on (repeatable); "
                        "one that changes a row's numbers makes its runs extra runs, not the row's")
    parser.add_argument("--gpu-tests", default="", metavar="K_EXPR",
                        help="first run the gpu tests selected by this pytest -k expression (make test-gpu; "
                        f"<out>/{gate.LOG_NAME}, <out>/{gate.JUNIT_NAME}); a failure does not stop the rows")
    parser.add_argument("--gpu-tests-timeout", type=float, default=240.0, metavar="S",
                        help="stop the gpu tests after S seconds (default 240)")
    parser.add_argument("--try-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting that leaves a row's numbers as they are (one of "
                        f"{', '.join(NON_RESULT_FIELDS)}), e.g. train.compile=cudagraphs: each row is run with it "
                        "first and, where that run fails, again without it as a new run (repeatable)")
    parser.add_argument("--try-if-passed", default="", metavar="NAME",
                        help="use --try-override for a row only where every test of --gpu-tests whose id contains "
                        "NAME passed; {row} in NAME stands for the row's name, e.g. 'cudagraph_step[{row}]'")
    args = parser.parse_args(argv)
    extra = tuple(args.override)
    tries = tuple(args.try_override)
    for flag, items in (("--override", extra), ("--try-override", tries)):
        for item in items:
            if "=" not in item or " " in item:
                raise SystemExit(f"{flag} {item!r} is not KEY=VALUE without spaces: e.g. {flag} train.compile=on")
    for item in tries:
        if item.partition("=")[0] not in NON_RESULT_FIELDS:
            raise SystemExit(f"--try-override {item!r}: only a setting that cannot change a row's numbers is tried "
                             f"and dropped ({', '.join(NON_RESULT_FIELDS)}); give others as --override")
    if args.try_if_passed and not (args.gpu_tests and tries):
        raise SystemExit("--try-if-passed needs --gpu-tests (the tests it reads) and --try-override (what it gates)")
    if args.make_site:
        print(f"{SITE}: {', '.join(make_site())}")
        return 0
    if args.unpack:
        for run in unpack_records(Path(args.unpack), Path(args.into)):
            print(f"[gpu_paper_rows] unpacked {run}")
        return 0
    if args.compile_cache is None:
        cache_dir = CACHE_DIR
    else:
        cache_dir = (REPO / args.compile_cache).resolve() if args.compile_cache else None
    if args.unpack_cache:
        if cache_dir is None:
            raise SystemExit("--unpack-cache needs a --compile-cache folder to extract into")
        print(f"[gpu_paper_rows] {unpack_cache(Path(args.unpack_cache), cache_dir)} file(s) -> {cache_dir}")
        return 0
    device = args.device or ACCELERATOR[args.backend]
    rows = parse_rows(args.rows)
    start = time.monotonic()
    python, env = sys.executable, child_env()
    if cache_dir is not None:
        cache_env(env, cache_dir)
    out, output_root = Path(args.out).resolve(), Path(args.output_root).resolve()
    (out / "step_cost").mkdir(parents=True, exist_ok=True)
    print(f"[gpu_paper_rows] PYTHONPATH={env['PYTHONPATH']}", flush=True)
    for variable, _ in CACHE_VARIABLES:
        if variable in env:
            print(f"[gpu_paper_rows] {variable}={env[variable]}", flush=True)
    missing = missing_packages(python, env)
    if missing:  # before the gpu tests' minutes: without them every step cost and row would fail at once
        raise SystemExit(f"{python} cannot import {', '.join(missing)} with PYTHONPATH={env['PYTHONPATH']}: run "
                         f"`.venv/bin/python -m experiments.gpu_paper_rows --make-site` in the project's checkout and "
                         f"bring {SITE.name}/ along (the packages a step needs beside torch and JAX)")
    code = 0
    outcomes: dict[str, str] = {}
    if args.gpu_tests:
        print(f"[gpu_paper_rows] gpu tests -k {args.gpu_tests!r} -> {out / gate.LOG_NAME}", flush=True)
        rc, outcomes = gate.run_gpu_tests(args.gpu_tests, out, python, env, args.gpu_tests_timeout, REPO)
        print(f"[gpu_paper_rows] {gate.summary(rc, outcomes)}", flush=True)
    if args.step_cost is None:
        args.step_cost = ",".join(dict.fromkeys(t for t, _ in rows)) or ",".join(PAPER_TABLES)
    for table in [t for t in args.step_cost.split(",") if t]:
        name = table if args.backend == "torch" else f"{table}_{args.backend}"
        # Only the rows this command will train, where it was given some of this table: each row timed costs
        # its build and compile (10-20 s for a compiled one) of the machine's time.
        given = tuple(dict.fromkeys(r for t, r in rows if t == table))
        cmd = step_cost_command(table, args.scale, device, out / "step_cost" / f"{name}.csv", python, args.backend,
                                given, extra)
        print(f"[gpu_paper_rows] {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        code = code or rc
        report_cache(cache_dir, out)
    costs = predicted_seconds(out, args.backend)
    for table, row in rows:
        left = args.budget_s - (time.monotonic() - start)
        need = costs.get((table, row))
        if args.budget_s and need is not None and need > left:
            print(f"[gpu_paper_rows] skipped {table}/{row}: predicted {need:.0f} s for its run, {left:.0f} s left",
                  flush=True)
            continue
        row_tries = tries
        if tries and args.try_if_passed:
            passed, why = gate.gate(outcomes, args.try_if_passed.replace("{row}", row))
            print(f"[gpu_paper_rows] {why}: {table}/{row} runs {'with' if passed else 'without'} "
                  f"{' '.join(tries)}", flush=True)
            row_tries = tries if passed else ()
        # With --try-override: the tried settings first; where that run fails, the row again without them, as a
        # new run (--fresh: the failed run's resume view has the tried settings, so it cannot be continued).
        attempts = [(extra + row_tries, False), (extra, True)] if row_tries else [(extra, False)]
        for attempt, (overrides, fresh) in enumerate(attempts):
            cmd = reproduce_command(table, row, args.scale, device, output_root, python, args.backend, overrides,
                                    fresh)
            print(f"[gpu_paper_rows] {' '.join(cmd)}", flush=True)
            rc = subprocess.call(cmd, cwd=REPO, env=env)
            copied = copy_records(output_root, table, args.scale, row, out / "runs", args.backend)
            packed = pack_records(out / "runs", out / ARCHIVE_NAME) if (out / "runs").is_dir() else 0
            print(f"[gpu_paper_rows] {table}/{row}: exit {rc}, {len(copied)} completed run record(s) -> "
                  f"{', '.join(str(p) for p in copied) or 'none'}; {out / ARCHIVE_NAME}: {packed} file(s)",
                  flush=True)
            report_cache(cache_dir, out)
            failed = rc or not copied
            if not failed or attempt == len(attempts) - 1:
                break
            print(f"[gpu_paper_rows] {table}/{row} failed with {' '.join(row_tries)}: running it again without "
                  "(--try-override)", flush=True)
        code = code or rc or (1 if failed else 0)
        if failed and args.stop_on_failure:
            left = [f"{t}/{r}" for t, r in rows[rows.index((table, row)) + 1:]]
            if left:
                print(f"[gpu_paper_rows] stopped after {table}/{row} failed (--stop-on-failure); not trained: "
                      f"{' '.join(left)}", flush=True)
            break
    print(f"[gpu_paper_rows] done in {time.monotonic() - start:.0f} s (exit {code})", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

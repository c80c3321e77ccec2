"""``experiments.allocator``: the entry points re-execute once with the suite's glibc tunables, keep a
user's own tunables, respect the opt-out, and run records say which allocator settings were in effect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import allocator

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not allocator.applies() and not os.environ.get(allocator.OPT_OUT),
                                reason="glibc tunables exist on glibc Linux only")

PROBE = textwrap.dedent("""
    import json, os, sys
    from experiments.allocator import ensure_tunables, active
    print("start", flush=True)
    ensure_tunables()
    print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES", ""), "active": active(),
                      "argv": sys.argv[1:]}))
""")


def _probe(tmp_path: Path, env_extra: dict[str, str]) -> tuple[list[str], dict]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", allocator.OPT_OUT, "PCAF_MALLOC_REEXEC")}
    env.update(env_extra, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(script), "a b", "--flag"], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    return out[:-1], json.loads(out[-1])


def test_reexecutes_once_with_the_tunables_and_the_same_arguments(tmp_path):
    before, info = _probe(tmp_path, {})
    assert before == ["start", "start"]  # the original process and its one re-execution
    assert info["active"] and info["tunables"] == allocator.TUNABLES
    assert info["argv"] == ["a b", "--flag"]


def test_keeps_the_users_tunables_and_does_not_reexecute_when_already_set(tmp_path):
    _, info = _probe(tmp_path, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert info["tunables"] == "glibc.malloc.arena_max=2:" + allocator.TUNABLES
    before, info = _probe(tmp_path, {"GLIBC_TUNABLES": allocator.TUNABLES})
    assert before == ["start"] and info["active"]


def test_opt_out(tmp_path):
    before, info = _probe(tmp_path, {allocator.OPT_OUT: "1"})
    assert before == ["start"] and not info["active"]


@pytest.mark.slow
def test_run_records_name_the_allocator_settings(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PCAF_MALLOC_REEXEC")}
    subprocess.run([sys.executable, "-m", "experiments.run", "experiment=wt2-nt-1024/local_conv", "scale=smoke",
                    "train.steps=1", f"output_root={tmp_path}"], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=300)
    (env_file,) = tmp_path.glob("wt2-nt-1024/smoke/torch/local_conv/*/environment.json")
    assert json.loads(env_file.read_text())["malloc"] == allocator.TUNABLES

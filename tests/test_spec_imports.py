"""pcaf_core is backend-neutral: it imports neither torch nor jax; the two backends never import each other."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pcaf_core

FORBIDDEN = {"torch", "jax", "jaxlib", "flax", "optax", "triton"}


def _imports(root: Path) -> list[tuple[str, str]]:
    """(file, absolute module name) of every import statement under ``root``."""
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(path.name, node.module)]
    return found


def test_no_source_file_imports_a_backend():
    root = Path(pcaf_core.__file__).parent
    offenders = [f"{f}: {m}" for f, m in _imports(root) if m.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_the_backends_never_import_each_other():
    backends = Path(pcaf_core.__file__).parents[1] / "backends"
    pairs = (("torch", "jax", {"jax", "jaxlib", "flax", "optax"}), ("jax", "torch", {"torch", "triton"}))
    for mine, other, framework in pairs:
        found = _imports(backends / mine)
        assert len(found) > 20  # the walk sees the package
        offenders = [f"{f}: {m}" for f, m in found if m.startswith(f"backends.{other}") or m.split(".")[0] in framework]
        assert not offenders, (mine, offenders)


def test_importing_every_module_loads_no_backend():
    mods = [m.name for m in pkgutil.walk_packages(pcaf_core.__path__, "pcaf_core.") if not m.name.endswith("__main__")]
    assert "pcaf_core.reference" in mods
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

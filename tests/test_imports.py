"""The package's import graph (scripts/studies/import_graph.py --check): no import cycles between
its modules, no module using another's `_private` names, no import of `dflash_jax.train` from
outside it (deferred ones included), and the default decode path (load the embedded target and its
shipped draft, generate) loads no training module. The check fails on a planted cycle, a planted
private import and a planted training import."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "studies", "import_graph.py")


def _run(*args):
  return subprocess.run([sys.executable, SCRIPT, "--check", *args], capture_output=True,
                        text=True, timeout=900)


def test_import_graph_of_the_package():
  r = _run()
  assert r.returncode == 0, r.stdout + r.stderr
  assert "cycles: 0" in r.stdout and "_private names: 0" in r.stdout
  assert "imports of dflash_jax.train from outside it: 0" in r.stdout
  assert "training modules among them: none" in r.stdout


def test_the_check_fails_on_planted_violations(tmp_path):
  import dflash_jax
  pkg = tmp_path / "dflash_jax"
  shutil.copytree(os.path.dirname(dflash_jax.__file__), pkg,
                  ignore=shutil.ignore_patterns("__pycache__", "*.json"))
  assert _run("--root", str(pkg), "--no_generate").returncode == 0
  with open(pkg / "quants.py", "a") as fh:             # quants <- serve <- ... : a cycle
    fh.write("\nfrom dflash_jax import serve\n")
  r = _run("--root", str(pkg), "--no_generate")
  assert r.returncode == 1 and "cycles: 1" in r.stdout and "dflash_jax.quants" in r.stdout
  with open(pkg / "quants.py", "a") as fh:
    fh.write("from dflash_jax.api import _no_such_private_name\n")
  r = _run("--root", str(pkg), "--no_generate")
  assert r.returncode == 1 and "dflash_jax.api._no_such_private_name" in r.stdout
  pkg2 = tmp_path / "b" / "dflash_jax"
  shutil.copytree(os.path.dirname(dflash_jax.__file__), pkg2,
                  ignore=shutil.ignore_patterns("__pycache__", "*.json"))
  with open(pkg2 / "ngram.py", "a") as fh:                 # the decode side reaching training
    fh.write("\ndef _f():\n  from dflash_jax.train import objective\n")
  r = _run("--root", str(pkg2), "--no_generate")
  assert r.returncode == 1 and "dflash_jax.ngram -> dflash_jax.train" in r.stdout

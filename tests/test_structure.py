"""The package's shape, checked: no import circles, no oversized file, imports only downward.

Layers (`_src/nnx`) -> ops (`_src/ring`, `_src/paged`) -> backends (`_src/backends`); the shared floor
(`options`, `masks`, `flash`, `validation`, ...) below all of them.  Function-level imports count too: a lazy
import that closes a circle is still a circle.
"""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "flax_ringattn"
MAX_LINES = 600


def _module(path: pathlib.Path) -> str:
  rel = path.relative_to(PKG.parent).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _graph():
  modules = {_module(p): p for p in PKG.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flax_ringattn"):
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          deps.add(full if full in modules else node.module)
      elif isinstance(node, ast.Import):
        deps.update(a.name for a in node.names if a.name.startswith("flax_ringattn"))
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
    closed = set()
    for d in deps:
      parts = d.split(".")
      closed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    graph[name] = {d for d in closed if d in modules and d != name and not name.startswith(d + ".")}
  return graph


def _cycles(graph):
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
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

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
  assert _cycles(_graph()) == []


def test_no_library_file_over_the_limit():
  long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert long == {}


def _imports_of(prefix):
  graph = _graph()
  return {m: deps for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".")}


def test_imports_point_downward():
  ops = ("flax_ringattn._src.ring", "flax_ringattn._src.paged")
  for module, deps in _imports_of("flax_ringattn._src.backends").items():
    up = {d for d in deps if d.startswith(ops + ("flax_ringattn._src.nnx", "flax_ringattn._src.serving"))}
    assert not up, f"backend {module} imports an op or a layer: {sorted(up)}"
  for module, deps in _imports_of("flax_ringattn._src.nnx").items():
    up = {d for d in deps if d.startswith("flax_ringattn._src.serving")}
    assert not up, f"layer module {module} imports the serving engine above it: {sorted(up)}"
  for op in ops:
    for module, deps in _imports_of(op).items():
      up = {d for d in deps if d.startswith(("flax_ringattn._src.nnx", "flax_ringattn._src.serving"))}
      assert not up, f"op module {module} imports a layer: {sorted(up)}"
      text = (PKG.parent / (module.replace(".", "/") + ".py")).read_text() if not module.endswith(op) else ""
      assert "from flax import" not in text and "import flax\n" not in text, f"op module {module} imports flax"


def test_the_matcher_is_jaxpr_analysis_only():
  """The hand-written-attention matcher (`_src/matcher`) imports neither an op, a layer, a backend nor flax."""
  above = (
    "flax_ringattn._src.ring",
    "flax_ringattn._src.paged",
    "flax_ringattn._src.nnx",
    "flax_ringattn._src.backends",
  )
  for module, deps in _imports_of("flax_ringattn._src.matcher").items():
    assert not {d for d in deps if d.startswith(above)}, f"{module} imports {sorted(deps)}"
    path = PKG.parent / module.replace(".", "/")
    text = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    assert "from flax import" not in text and "import flax\n" not in text, module

"""The documentation stays true: every Python block of the README and of the docs pages runs as written (in order,
one fresh process per page, 8 CPU devices, the suite's compile flags), every public name has a docstring and a page
in the API reference, and the API table lists each call's parameters as the code has them.  The site's build with warnings as errors is
`make docs`, the step after `make test` in `.ci/run`."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
NO_RUN = "<!-- no-run"  # `<!-- no-run: why -->` on the line before a block keeps it from running

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
  """The page's Python blocks in order, without those marked `<!-- no-run ... -->` on the line before."""
  blocks = []
  for match in _BLOCK.finditer(text):
    before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
    if not before.startswith(NO_RUN):
      blocks.append(match.group(1))
  return blocks


def test_no_run_markers_say_why():
  for page in PAGES:
    for line in page.read_text().splitlines():
      if line.startswith(NO_RUN):
        assert re.match(r"<!-- no-run: \S.* -->$", line), f"{page.name}: a no-run marker without a reason: {line}"


def test_python_blocks_are_found():
  assert python_blocks("x\n```python\na = 1\n```\n<!-- no-run: shown only -->\n```python\nb = 2\n```\n") == ["a = 1\n"]
  assert sum(len(python_blocks(p.read_text())) for p in PAGES) >= 20


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_page_python_blocks_run_as_written(page, tmp_path):
  """A page's blocks, concatenated in order, run in a fresh Python with 8 CPU devices, as a reader would run them
  (their own asserts check what they show)."""
  script = tmp_path / f"{page.stem}.py"
  script.write_text("\n\n".join(python_blocks(page.read_text())))
  env = dict(os.environ)
  # 8 CPU devices as the pages say, and the suite's compile flags (conftest: cheap LLVM passes, loop emitters).
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.run(
    [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, f"{page.name}'s code failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# -- the API reference is complete -------------------------------------------------------------------


def test_every_public_name_has_a_docstring_and_an_api_page():
  import flax_ringattn as fr

  listed = set(re.findall(r"^   (\w+)$", (DOCS / "api_names.rst").read_text(), re.M))
  missing = [name for name in fr.__all__ if name not in listed]
  assert not missing, f"docs/api_names.rst lacks {missing}"
  undocumented = [name for name in fr.__all__ if not (inspect.getdoc(getattr(fr, name)) or "").strip()]
  assert not undocumented, f"public names without a docstring: {undocumented}"
  toctree = (DOCS / "index.md").read_text()
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index", "api"}
  assert all(re.search(rf"^{p}$", toctree, re.M) for p in pages), (pages, toctree)


# -- the API table cannot drift from the code ---------------------------------------------------------

_CALL = re.compile(r"`((?:[A-Za-z_][\w.]*))\(([^`]*)\)`")


def _api_rows():
  """[(first cell, description)] of the API table in docs/api.md."""
  text = (DOCS / "api.md").read_text()
  table = text.split("## At a glance", 1)[1].split("\n\n", 2)[1]
  rows = []
  for line in table.splitlines()[2:]:
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    rows.append((cells[0], cells[1]))
  return rows


def _resolve(name):
  import flax_ringattn as fr

  obj = fr
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _table_params(args: str):
  """Parameter names as the table writes them (`*` dropped, `x="a" \\| "b"` -> x, `**kw` kept)."""
  return [arg.strip().split("=")[0].strip() for arg in args.split(",") if arg.strip() not in ("", "*")]


def _code_params(obj):
  sig = inspect.signature(obj)
  out = []
  for p in sig.parameters.values():
    if p.name == "self":
      continue
    out.append(("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "") + p.name)
  return out


def test_api_table_matches_signatures():
  """Every `name(args)` of the table lists exactly the parameters of that public name, in order; a row written
  `Layer(...)` lists the layer's own keyword-only options after its '+'."""
  from flax import nnx

  checked = 0
  for cell, description in _api_rows():
    for name, args in _CALL.findall(cell):
      obj = _resolve(name)
      if args.strip() == "...":
        flax_params = set(inspect.signature(nnx.MultiHeadAttention.__init__).parameters)
        own = [
          p.name
          for p in inspect.signature(obj.__init__).parameters.values()
          if p.kind is p.KEYWORD_ONLY and p.name not in flax_params
        ]
        listed = re.findall(r"`(\w+)`", description.split("+", 1)[1].split(";")[0])
        assert listed == own, f"API row {name}(...): lists {listed}, the code's own options are {own}"
      else:
        assert _table_params(args) == _code_params(obj), f"API row {name}({args}) != signature {_code_params(obj)}"
      checked += 1
  assert checked >= 15, checked


def test_launch_docstring_points_at_a_docs_section():
  import flax_ringattn.launch as launch

  sections = re.findall(r'"([^"]+)"\)', launch.__doc__)
  headings = {h for page in DOCS.glob("*.md") for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}
  assert sections and all(s in headings for s in sections), (sections, sorted(headings))

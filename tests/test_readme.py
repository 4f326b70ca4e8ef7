"""The README's Python code blocks run, in order, in one namespace."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 3
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == namespace["q"].shape
  assert float(namespace["loss"]) >= 0.0
  assert namespace["y"].shape == (32, 64)
  # The convert section ran and the pytest example really passes.
  assert namespace["report"].replaced == ["attn"]
  assert (namespace["same"] == (namespace["mask"] != 0)).all()
  namespace["test_my_attention_matches_reference"](namespace["jnp"].bfloat16)
  # The hand-written section converted its block, and the manual port ran.
  assert [s.path for s in namespace["hw_report"].converted] == ["<root>"]
  assert namespace["y_hw"].shape == namespace["x_hw"].shape
  assert namespace["o_hw"].shape == namespace["q_hw"].shape
  # Serving: the engine ran the unedited model, and the draft changed nothing.
  assert namespace["fast"] == namespace["outs"] and all(len(o) == 4 for o in namespace["outs"])
  # Masks and layouts: a permuted, chunked, image-span call equals the reference in that order; the pack balances.
  err = namespace["jnp"].abs(namespace["out_m"] - namespace["take"](namespace["want_m"])).max()
  assert float(err) < 1e-5, err
  assert namespace["layout"].imbalance <= 1.05


# -- the API table cannot drift from the code -----------------------------------------------------

_CALL = re.compile(r"`((?:[A-Za-z_][\w.]*))\(([^`]*)\)`")


def _api_rows():
  """[(first cell, description)] of the README's API table."""
  text = README.read_text()
  table = text.split("## API", 1)[1].split("\n\n", 2)[1]
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


def _readme_params(args: str):
  """Parameter names as the README writes them (`*` dropped, `x="a" \\| "b"` -> x, `**kw` kept)."""
  names = []
  for arg in args.split(","):
    arg = arg.strip()
    if not arg or arg == "*":
      continue
    names.append(arg.split("=")[0].strip())
  return names


def _code_params(obj):
  import inspect

  sig = inspect.signature(obj)
  out = []
  for p in sig.parameters.values():
    if p.name == "self":
      continue
    out.append(("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "") + p.name)
  return out


def test_readme_api_table_matches_signatures():
  """Every `name(args)` of the API table lists exactly the parameters of that public name, in order; a row
  written `Layer(...)` lists the layer's own keyword-only options after its '+'."""
  import inspect

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
        assert listed == own, f"README row {name}(...): lists {listed}, the code's own options are {own}"
      else:
        assert _readme_params(args) == _code_params(obj), f"README row {name}({args}) != signature {_code_params(obj)}"
      checked += 1
  assert checked >= 15, checked


def test_launch_docstring_points_at_a_readme_section():
  import flax_ringattn.launch as launch

  sections = re.findall(r'"([^"]+)"\)', launch.__doc__)
  headings = set(re.findall(r"^#+ (.+)$", README.read_text(), flags=re.M))
  assert sections and all(s in headings for s in sections), (sections, headings)

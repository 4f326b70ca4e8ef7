"""The public surface as a user meets it: docstrings, signatures in `help()`, `py.typed`, the examples' `--help`."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pathlib
import pydoc
import re
import subprocess
import sys

import pytest
from flax import nnx

import flax_ringattn as fr

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
PUBLIC_MODULES = ("flax_ringattn.benchmarking", "flax_ringattn.testing", "flax_ringattn.launch")


def _public(name):
  return getattr(fr, name)


# -- docstrings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", fr.__all__)
def test_public_name_has_its_own_docstring(name):
  """A docstring written for it: not missing, and not the `Name(field: type, ...)` text dataclasses generate."""
  doc = (_public(name).__doc__ or "").strip()
  assert doc, f"fr.{name} has no docstring"
  assert not doc.startswith(f"{name}("), f"fr.{name} has only the generated dataclass docstring: {doc[:80]!r}"


def _fields(cls):
  if dataclasses.is_dataclass(cls):
    return [f.name for f in dataclasses.fields(cls)]
  return list(getattr(cls, "_fields", ()))  # a NamedTuple


_RECORDS = [name for name in fr.__all__ if inspect.isclass(_public(name)) and _fields(_public(name))]


@pytest.mark.parametrize("name", _RECORDS)
def test_public_record_names_every_field(name):
  """`help()` does not show a dataclass's field comments: each field is named in the docstring."""
  cls = _public(name)
  missing = [f for f in _fields(cls) if f not in cls.__doc__]
  assert not missing, f"fr.{name}'s docstring does not name the fields {missing}"


def test_records_found():
  assert {"PagedKVCache", "BlockSizes", "Mask", "DenseStructure"} <= set(_RECORDS), _RECORDS


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_has_a_docstring(module):
  assert (importlib.import_module(module).__doc__ or "").strip(), f"{module} has no module docstring"


# -- signatures -----------------------------------------------------------------------------------


def _init_signature(cls):
  sig = inspect.signature(cls.__init__)
  return sig.replace(parameters=tuple(sig.parameters.values())[1:])


_CLASSES = [n for n in fr.__all__ if inspect.isclass(_public(n)) and inspect.isfunction(_public(n).__init__)]
_MODULES = [n for n in _CLASSES if issubclass(_public(n), nnx.Module)]


def test_the_layers_are_checked():
  assert {"RingMultiHeadAttention", "PagedMultiHeadAttention"} <= set(_MODULES), _MODULES


@pytest.mark.parametrize("name", _CLASSES)
def test_class_signature_is_its_init(name):
  """nnx's metaclass `__call__(*args, **kwargs)` would hide the parameters from `inspect.signature` and IDEs."""
  cls = _public(name)
  assert inspect.signature(cls) == _init_signature(cls)


@pytest.mark.parametrize("name", _MODULES)
def test_help_shows_the_layer_parameters(name):
  cls = _public(name)
  text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
  header = next(line for line in text.splitlines() if line.lstrip(" |").startswith(f"{name}("))
  assert "num_heads" in header and "in_features" in header and "*args" not in header, header


def test_a_subclass_shows_its_own_init_and_an_instance_its_call():
  class Sub(fr.RingMultiHeadAttention):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
      super().__init__(num_heads=2, in_features=width, rngs=rngs)

  assert list(inspect.signature(Sub).parameters) == ["width", "rngs"]
  layer = Sub(8, rngs=nnx.Rngs(0))
  assert inspect.signature(layer) == inspect.signature(layer.__call__)
  assert "inputs_q" in inspect.signature(layer).parameters


# -- packaging ------------------------------------------------------------------------------------


def test_package_is_marked_typed():
  """PEP 561: `py.typed` beside `__init__.py` (hatchling ships every file of the package in the wheel)."""
  assert (pathlib.Path(fr.__file__).parent / "py.typed").is_file()


# -- the examples' --help shows every default -----------------------------------------------------


def _help(script: pathlib.Path) -> str:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run(
    [sys.executable, str(script), "--help"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
  )
  assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
  return proc.stdout


def _options(help_text: str):
  """(invocation, whole entry with its wrapped lines joined) per option of an argparse help text."""
  body = help_text.split("\noptions:\n", 1)[1]
  entries = []
  for line in body.splitlines():
    if re.match(r"^  -", line):
      entries.append([line.strip()])
    elif line.startswith("   ") and entries:
      entries[-1].append(line.strip())
    elif line.strip():
      break  # the next section
  return [(re.split(r"\s{2,}", e[0])[0], " ".join(e)) for e in entries]


def test_options_parser():
  text = "usage: x\n\noptions:\n  -h, --help  show\n  --pack      flag\n  --seq-len SEQ_LEN\n          n (default:\n          8)\n"
  assert _options(text) == [
    ("-h, --help", "-h, --help  show"),
    ("--pack", "--pack      flag"),
    ("--seq-len SEQ_LEN", "--seq-len SEQ_LEN n (default: 8)"),
  ]


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_help_shows_every_default(script):
  options = _options(_help(script))
  valued = [(inv, entry) for inv, entry in options if not all(t.startswith("-") for t in inv.replace(",", " ").split())]
  assert valued, options
  hidden = [inv for inv, entry in valued if "(default:" not in entry]
  assert not hidden, f"{script.name} --help does not show the default of {hidden}"

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

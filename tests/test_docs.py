"""The README's and docs' Python snippets run as written, and the README shows the quick start."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from attnsdk import _registry

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "docs/architecture.md",
    "docs/kv_layout.md",
    "docs/adding_a_backend.md",
    "docs/debugging.md",
    "docs/adapters/sglang.md",
    "docs/adapters/vllm.md",
]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(doc: str) -> list[str]:
    return BLOCK.findall((ROOT / doc).read_text())


SNIPPETS = [(doc, i, code) for doc in DOCS for i, code in enumerate(python_blocks(doc))]


@pytest.fixture(autouse=True)
def registry_state() -> Iterator[None]:
    saved = dict(_registry._REGISTRY)
    yield
    with _registry._LOCK:
        _registry._REGISTRY.clear()
        _registry._REGISTRY.update(saved)


@pytest.mark.parametrize(
    ("doc", "index", "code"), SNIPPETS, ids=[f"{doc}[{i}]" for doc, i, _ in SNIPPETS]
)
def test_snippet_runs(doc: str, index: int, code: str) -> None:
    exec(compile(code, f"{doc}[{index}]", "exec"), {"__name__": f"snippet_{index}"})


def test_readme_usage_is_the_quickstart_example() -> None:
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("## Usage", 1)[1]
    (first, *_) = BLOCK.findall(usage)
    example = (ROOT / "examples" / "quickstart.py").read_text()
    code = example.split('"""', 2)[2].lstrip("\n")  # without the module docstring
    assert first == code


def test_readme_quick_start_has_exactly_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands[0].startswith("git clone ")
    assert commands[0].endswith("&& cd attnsdk")
    assert commands[1:] == ["make demo", "make test"]

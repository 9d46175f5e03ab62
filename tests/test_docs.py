"""The code in the documentation runs: every ```python block of docs/**/*.md and README.md, on the CPU, and every
`python examples/...` command of a ```bash block names an existing script and flags that script accepts.

The python blocks of one page run in order in one namespace (a page's first block sets up what its later ones
use), in a temporary directory. A block that cannot run here is preceded by the line
``<!-- not run: REASON -->``; it is reported as skipped with its reason, and their number is capped so that
the set stays small.
"""
from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
MAX_NOT_RUN = 8


def pages() -> list[Path]:
    # docs/results/ is generated from the benchmark files (benchmarks/results_pages.py) and holds no code.
    found = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "results" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md"] + found


def blocks(page: Path) -> list[tuple[str, str, str | None, int]]:
    """(language, code, reason it is not run or None, line) of each fenced block."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        indent = match["indent"]
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in match["body"].rstrip("\n").split("\n"))
        found.append((match["lang"], code, reason and reason[1], text.count("\n", 0, match.start()) + 1))
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


PAGES_WITH_PYTHON = [p for p in pages() if any(lang == "python" and not reason for lang, _, reason, _ in blocks(p))]
NOT_RUN_BLOCKS = [(p, line, reason) for p in pages() for lang, _, reason, line in blocks(p) if reason]


def test_the_documentation_has_code_to_run():
    assert len(PAGES_WITH_PYTHON) >= 8, [_name(p) for p in PAGES_WITH_PYTHON]


@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=_name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    for lang, code, reason, line in blocks(page):
        if lang == "python" and not reason:
            try:
                exec(compile(code, f"{_name(page)}:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"the python block at {_name(page)}:{line} fails: {error!r}") from error


def test_the_readme_training_example_prints_its_loss(tmp_path, monkeypatch, capsys):
    """A reader who runs the README's "In a training script" example sees that it worked."""
    monkeypatch.chdir(tmp_path)
    (code,) = [code for lang, code, _, _ in blocks(ROOT / "README.md") if lang == "python" and "coat.optim.AdamW" in code]
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert capsys.readouterr().out == f"loss {namespace['loss'].item():.3f}\n"


@pytest.mark.parametrize("page,line,reason", NOT_RUN_BLOCKS, ids=[f"{_name(p)}:{n}" for p, n, _ in NOT_RUN_BLOCKS])
def test_blocks_marked_not_run(page, line, reason):
    pytest.skip(f"{_name(page)}:{line} not run: {reason}")


def test_few_blocks_are_marked_not_run():
    assert len(NOT_RUN_BLOCKS) <= MAX_NOT_RUN, [f"{_name(p)}:{n}" for p, n, _ in NOT_RUN_BLOCKS]


def _flags(script: Path, seen: set[Path] | None = None) -> set[str]:
    """The --flags that ``script`` and the examples modules it imports give argparse."""
    seen = seen if seen is not None else set()
    seen.add(script)
    tree = ast.parse(script.read_text())
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else [a.name for a in node.names]
            for name in names:
                local = script.parent / f"{name}.py"
                if local.exists() and local not in seen:
                    flags |= _flags(local, seen)
    return flags | {"-h", "--help"}


def example_commands() -> list[tuple[str, int, list[str]]]:
    """(page, line, the words of one command) for each `python examples/X.py ...` or `torchrun ... examples/X.py`."""
    found = []
    for page in pages():
        for lang, code, _, line in blocks(page):
            if lang not in ("bash", "sh", "shell"):
                continue
            for command in re.split(r"&&|\|\||;|\n", code):
                words = shlex.split(command, comments=True)
                if any(w.startswith("examples/") and w.endswith(".py") for w in words):
                    found.append((_name(page), line, words))
    return found


EXAMPLE_COMMANDS = example_commands()


def test_the_documentation_has_example_commands():
    assert len(EXAMPLE_COMMANDS) >= 5


@pytest.mark.parametrize("page,line,words", EXAMPLE_COMMANDS, ids=[f"{p}:{n}:{' '.join(w)[:60]}" for p, n, w in EXAMPLE_COMMANDS])
def test_example_commands_name_existing_scripts_and_flags(page, line, words):
    at = next(i for i, w in enumerate(words) if w.startswith("examples/") and w.endswith(".py"))
    script = ROOT / words[at]
    assert script.exists(), f"{page}:{line} runs {words[at]}, which does not exist"
    unknown = {w.split("=", 1)[0] for w in words[at + 1:] if w.startswith("-")} - _flags(script)
    assert not unknown, f"{page}:{line}: {words[at]} has no flag {sorted(unknown)}"


def test_the_flag_parser_sees_flags_of_imported_modules():
    flags = _flags(ROOT / "examples" / "train_llama.py")
    assert {"--coat", "--compare", "--report-every", "--preset"} <= flags  # --coat is in training_common.py
    assert "--no-such-flag" not in flags


def test_a_block_after_a_not_run_marker_is_not_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: needs a GPU -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n")
    assert [(lang, reason) for lang, _, reason, _ in blocks(page)] == [("python", "needs a GPU"), ("python", None)]


def test_indented_blocks_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("- item\n\n  ```bash\n  python examples/train_llama.py --coat\n  ```\n")
    assert blocks(page) == [("bash", "python examples/train_llama.py --coat", None, 3)]


def test_a_failing_block_fails_its_page(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nundefined_name + x\n```\n")
    with pytest.raises(AssertionError, match="page.md:5 fails"):
        test_python_blocks_run(page, tmp_path, monkeypatch)


def test_the_readmes_relative_links_name_existing_files():
    """mkdocs --strict checks the links inside docs/; the README is read on GitHub, outside the site."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into the docs"
    assert [link for link in relative if not (ROOT / link).exists()] == []

"""The examples of the README and the docs pages run as written, and every output they
show is the output the code prints now.

- Python examples run in order, each block in a fresh namespace, a page in a fresh
  dynamo session.
- An output a page shows is a ```console block. Right after a ```python block it is that
  block's standard output. Starting with ``$ command`` (after any ``$`` lines that show
  nothing), it is the last command's output, standard output then standard error, run
  here as the page says (:func:`run_shown_command`: ``tightfit`` in this process, ``make``
  through its Makefile recipe, ``python`` in a subprocess), in a folder of the page's own
  where the page's set-up (:data:`SETUP`) has run. :data:`NOT_COMPARED` names every shown
  output that is not compared, with the reason; :data:`ELSEWHERE` the ones another test
  compares. A console block that is none of these fails
  :func:`test_every_shown_output_is_compared_or_excused`.

How outputs are compared (:func:`assert_shows`): line by line, blank lines dropped,
whitespace runs collapsed (a table's alignment follows its widest value), runs of a rule
character (``─━═-``) collapsed to one (a rule's length follows its column), and a table
row's wrapped lines joined into the row, its cells compared without spaces (where a cell
wraps follows its neighbours' widths). A shown
line ``...`` stands for any number of lines left out. Figures that the machine decides,
not the code, are masked on both sides where their label says what they are
(:data:`VOLATILE`): clock times and rates, the process's RSS, free and total memory, training losses. All
else is compared as printed: memory figures, plans, cosines, tokens, counts.

Plans depend on the time model's calibration (tightfit.fitting.calibrate), measured per
machine. The pages' plans were made with the figures in docs/examples/calibration-cpu.json
(measured on the 2-core machine the pages name); this module puts them into a fresh
``TIGHTFIT_CACHE_DIR`` under this machine's name, so the plans come out the same here.
Memory figures depend on the CPU's int8 matmul path (its scratch): the pages were made on
an AVX-512 CPU, whose path is ``torch._int_mm``, and the tests pin it
(``TIGHTFIT_CPU_INT8_PATH=int_mm``) so an AVX2 machine prints the same figures.
Commands run on the CPU backend (``TIGHTFIT_BACKEND=cpu``), as the pages' did; the
outputs that list the machine's backends (``tightfit check``) are compared only where
the CPU is the only one.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from zoo.lm import cache_docs_calibration

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "README.md",
    "docs/ops.md",
    "docs/quantization.md",
    "docs/kernels.md",
    "docs/hooks.md",
    "docs/hints.md",
    "docs/compile.md",
    "docs/memory.md",
    "docs/fit.md",
    "docs/load.md",
    "docs/checkpoints.md",
    "docs/migrating.md",
    "docs/optim.md",
    "docs/training.md",
    "docs/architecture.md",
    "docs/gpu.md",
    "docs/distributed.md",
]
#: Pages with outputs but no Python example of their own.
OUTPUT_PAGES = [*PAGES, "docs/backends.md"]

#: (what is masked, the lines it applies to, the figure masked): what the machine's load
#: or memory decides, never the code.
VOLATILE = (
    (
        "clock time or rate",
        re.compile(
            r"latency \(median|time to first token|decode speed|generation of \d+ tokens \(median|"
            r"load: checkpoint streamed|cases, seed|^last step:"
        ),
        re.compile(r"\d[\d.,]*\s?(?:ms|s|tokens/s)\b"),
    ),
    ("the process's RSS", re.compile(r"\bRSS\b"), re.compile(r"\d[\d.,]*\s?[KMGT]?i?B\b")),
    (
        "training losses: float sums whose order the CPU's kernels decide",
        re.compile(r"^loss by step:"),
        re.compile(r"\d+\.\d+"),
    ),
    ("free and total memory", re.compile(r"\bfree /"), re.compile(r"\d[\d.,]*\s?[KMGT]?i?B\b")),
    (
        "memory available when planned",
        re.compile(r"of memory available when planned"),
        re.compile(r"\d[\d.,]*\s?[KMGT]?i?B(?= of memory available)"),
    ),
)

#: Shown outputs not compared, by (page, the block's first line), and why.
NOT_COMPARED = {
    ("docs/compile.md", "$ python benchmarks/schedules.py --repeat 7"): (
        "a benchmark: its figures are timings and RSS of one dated run, and it takes minutes"
    ),
    ("docs/memory.md", "$ python benchmarks/memory_plan.py"): (
        "a benchmark over four models, inference and training, each run in several runtimes: minutes; "
        "tests/memory holds its predictions to the measured peaks"
    ),
    ("docs/distributed.md", "$ torchrun --nproc-per-node 2 --no-python tightfit stages --budget 60MB"): (
        "started by torchrun, two processes; tests/distributed runs the command under torchrun and holds each "
        "rank's measured peak to its plan and budget"
    ),
    ("docs/ops.md", "$ make fuzz"): (
        "22,000 cases in worker processes, minutes on 2 cores; tests/ops, tests/quant and tests/loading run "
        "the same campaigns on fewer cases"
    ),
}

#: Shown outputs another test compares.
ELSEWHERE = {
    ("docs/backends.md", "$ pip install -e docs/examples/tightfit-example-backend"): (
        "tests/test_docs_backends.py::test_page_shows_the_backends_table (with the example plugin installed)"
    ),
}

#: Outputs that list the machine's backends: compared only where the CPU is the only one.
CPU_ONLY = {("docs/ops.md", "$ tightfit check --failures-only")}


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    text: str
    follows_python: bool  # right after a ```python block, nothing but blank lines between

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text.strip() else ""

    @property
    def key(self) -> tuple[str, str]:
        return self.page, self.first_line

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found: list[Block] = []
    end = 0
    for match in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
        follows = bool(found) and found[-1].lang == "python" and not text[end : match.start()].strip()
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), match.group(2), follows))
        end = match.end()
    return found


def python_blocks(page: str) -> list[str]:
    return [block.text for block in page_blocks(page) if block.lang == "python"]


def shown_commands() -> list[Block]:
    """Console blocks that show a command's output."""
    return [
        block
        for page in OUTPUT_PAGES
        for block in page_blocks(page)
        if block.lang == "console" and block.first_line.startswith("$ ")
    ]


# -- comparing -------------------------------------------------------------------------


def _table_rows(lines: list[str]) -> list[str | list[str]]:
    """A table row's cells (``│ a │ b │``), with the lines a long cell wrapped onto (the
    first cell empty) joined into it: where a cell wraps depends on its neighbours' widths."""
    rows: list[str | list[str]] = []
    for line in lines:
        text = line.strip()
        if len(text) > 1 and text[0] == text[-1] == "│":
            cells = [cell.strip() for cell in text[1:-1].split("│")]
            previous = rows[-1] if rows else None
            if isinstance(previous, list) and len(previous) == len(cells) and not cells[0]:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(previous, cells)]
                continue
            rows.append(cells)
        else:
            rows.append(line)
    return rows


def normalize(text: str) -> list[str]:
    lines = []
    for row in _table_rows(text.splitlines()):
        line = " │ ".join(row) if isinstance(row, list) else row
        line = " ".join(re.sub(r"([─━═-])\1{2,}", r"\1", line).split())
        for _, label, figure in VOLATILE:
            if label.search(line):
                line = figure.sub("<masked>", line)
        if isinstance(row, list):  # a cell wraps at a space or inside a word: compare cells without spaces
            line = "│" + "│".join(cell.replace(" ", "") for cell in line.split("│")) + "│"
        if line:
            lines.append(line)
    return lines


def shows(shown: str, real: str) -> bool:
    pattern = "".join(r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in normalize(shown))
    return re.fullmatch(pattern, "".join(line + "\n" for line in normalize(real))) is not None


def difference(where: str, shown: str, real: str) -> str:
    diff = "\n".join(difflib.unified_diff(normalize(shown), normalize(real), "shown", "printed now", lineterm=""))
    return f"{where} shows an output the code no longer prints (normalized; '...' lines unmatched):\n{diff}"


def assert_shows(where: str, shown: str, real: str) -> None:
    if not shows(shown, real):
        pytest.fail(difference(where, shown, real))


def test_comparison_masks_only_what_the_machine_decides():
    table = "│ latency (median of 5) │   41.7 ms │\n│ peak memory, live tensors │  34.0 MiB │\n"
    assert shows(table, table.replace("41.7 ms", "106.3 ms").replace("│  ", "│ "))
    assert not shows(table, table.replace("34.0 MiB", "34.1 MiB"))
    assert shows("a\n...\nd\n", "a\nb\nc\nd\n") and shows("a\n...\nd\n", "a\nd\n")
    assert not shows("a\n...\nd\n", "a\nb\n") and not shows("a\nb\n", "a\nb\nc\n")
    assert shows("--------  ---\nx", "----  -------\nx") and not shows("peak RSS 1.0 GiB\nx", "peak RSS 2.0 GiB\ny")
    wrapped = "│ cpu │ 23.1 GiB free / 23.5 │ tightfit-example-backen │\n│     │ GiB                  │ d 0.1.0                 │\n"
    assert shows(wrapped, "│ cpu │ 7.8 GiB free / 15.6 GiB │ tightfit-example-backend 0.1.0 │\n")
    assert not shows(wrapped, "│ cpu │ 7.8 GiB free / 15.6 GiB │ tightfit-example-backend 0.2.0 │\n")


# -- running ---------------------------------------------------------------------------


def _makefile_recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line[1:].replace("$(VENV)", ".venv").replace("$(PY)", ".venv/bin/python"))
    return recipe


def run_shown_command(command: str, folder: Path, capsys, monkeypatch) -> str:
    """What ``command`` prints, as a terminal shows it: standard output, then standard error."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    program, args = words[0], words[1:]
    if program == "make":
        (recipe,) = _makefile_recipe(args[0])  # one command: echoed, then run
        return recipe + "\n" + run_shown_command(recipe.replace(".venv/bin/", ""), folder, capsys, monkeypatch)
    monkeypatch.chdir(folder)
    if program == "tightfit" and args[:1] == ["check"]:
        # a fresh process: the harness lists every registered op, and other tests register test ops here
        program, args = "python", ["-m", "tightfit_launcher", *args]
    if program == "tightfit":
        from tightfit.app import cli

        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        cli.main(args)
        out, err = capsys.readouterr()
        return out + err
    if program == "python":
        done = subprocess.run(
            [sys.executable, *args],
            cwd=folder,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        return done.stdout
    raise AssertionError(f"no way to run {program!r} here; add it to run_shown_command or NOT_COMPARED")


def _llama_demo(folder: Path) -> None:
    """docs/fit.md's set-up line, as written (its ``python`` is this interpreter)."""
    (bash,) = [b.text for b in page_blocks("docs/fit.md") if b.lang == "bash" and "save_causal_lm" in b.text]
    line = next(line for line in bash.splitlines() if line.startswith("python -c"))
    subprocess.run([sys.executable, *shlex.split(line)[1:]], cwd=folder, check=True, timeout=600)


def _example_py(folder: Path) -> None:
    """docs/compile.md runs 'the model above' as example.py."""
    (source,) = [text for text in python_blocks("docs/compile.md") if "class NoSoftmax" in text]
    (folder / "example.py").write_text(source)


#: What a page's folder holds before its commands run.
SETUP: dict[str, Callable[[Path], None]] = {"docs/fit.md": _llama_demo, "docs/compile.md": _example_py}


@pytest.fixture(autouse=True)
def docs_int8_path(monkeypatch):
    """The int8 matmul path of the pages' machine, whatever this CPU would choose."""
    from tightfit.ops import _cpu_int8

    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "int_mm")
    if _cpu_int8._path(64) != "int_mm":
        pytest.skip("torch._int_mm is not exact on this CPU, and the pages' memory figures were made with it")


@pytest.fixture(autouse=True)
def docs_calibration(tmp_path_factory, monkeypatch):
    """The pages' calibration, cached under this machine's name in a fresh folder; the
    native kernels are the session's (a command in a child process built them again: 10 s)."""
    folder = tmp_path_factory.getbasetemp() / "docs-calibration"
    kernels = Path(os.environ["TIGHTFIT_CACHE_DIR"]) / "kernels"
    if not (folder / "kernels").exists():
        kernels.mkdir(parents=True, exist_ok=True)
        folder.mkdir(exist_ok=True)
        (folder / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(folder))
    cache_docs_calibration()


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(page: str) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(Path(page).stem)
            if page in SETUP:
                SETUP[page](made[page])
        return made[page]

    return folder


# -- the tests -------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run_and_print_what_the_page_shows(page, capsys):
    blocks = page_blocks(page)
    assert any(block.lang == "python" for block in blocks), f"{page} has no python example"
    torch._dynamo.reset()  # each page is a fresh session: no page sees another's compiled frames
    printed, differ = "", []
    for block in blocks:
        if block.lang == "python":
            # "<page>", not the page's path: dynamo tokenizes the file a frame names (for its
            # source lines), and a Markdown page need not tokenize as Python
            exec(compile(block.text, f"<{page}>", "exec"), {})
            printed = capsys.readouterr().out
            assert printed, f"{block}: the example prints nothing to show"
        elif block.lang == "console" and block.follows_python and not shows(block.text, printed):
            differ.append(difference(str(block), block.text, printed))
    assert not differ, "\n\n".join(differ)  # every block of the page ran; these showed something else


@pytest.mark.parametrize("block", shown_commands(), ids=str)
def test_shown_command_output(block, page_folders, capsys, monkeypatch):
    if block.key in NOT_COMPARED or block.key in ELSEWHERE:
        pytest.skip(NOT_COMPARED.get(block.key) or f"compared in {ELSEWHERE[block.key]}")
    if block.key in CPU_ONLY and [b.name for b in __import__("tightfit").backends.available()] != ["cpu"]:
        pytest.skip("lists this machine's backends; the page's machine had the CPU only")
    monkeypatch.setenv("TIGHTFIT_BACKEND", "cpu")
    lines = block.text.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("$ "))
    assert all(line.startswith("$ ") for line in lines[:last]), f"{block}: output between commands"
    command, shown = lines[last][2:], "\n".join(lines[last + 1 :])
    assert shown.strip(), f"{block}: shows no output"
    real = run_shown_command(command, page_folders(block.page), capsys, monkeypatch)
    assert_shows(str(block), shown, real)


def test_every_shown_output_is_compared_or_excused():
    """A console block is a python example's output or a command's; nothing else."""
    for page in OUTPUT_PAGES:
        for block in page_blocks(page):
            if block.lang == "console":
                assert block.follows_python or block.first_line.startswith("$ "), (
                    f"{block}: a console block neither right after a python example nor starting with '$ command'"
                )
    for key in [*NOT_COMPARED, *ELSEWHERE, *CPU_ONLY]:
        assert key in {block.key for block in shown_commands()}, f"{key} names no shown command"

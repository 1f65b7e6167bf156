"""Every message the ``tightfit`` command prints names options as its user types them
(``--budget``, never ``budget`` or ``max_new_tokens``), says nothing of ``None``, and
suggests only what the command line can do; ``fit`` takes ``--model DIR`` as ``run`` and
``plan`` do. From Python the same messages name the keywords (``budget=``)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tightfit.app import cli
from tightfit.app.budget import allow_text, size_at_least
from tightfit.app.spelling import assigned, command_line, for_command_line, option
from tightfit.fitting import Allow


def _flags(command: str) -> set[str]:
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def _keywords(command: str) -> set[str]:
    """The command's options as Python keywords (``max_new_tokens``): a message must not say them."""
    return {flag[2:].replace("-", "_") for flag in _flags(command) if flag.startswith("--")} - {"help"}


def error_line(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    return lines[0]


def assert_speaks_the_command_line(line: str, command: str) -> None:
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
        assert flag in _flags(command), f"{flag} is not an option of tightfit {command}: {line}"
    words = set(re.findall(r"(?<![\w.'/-])[a-z][a-z0-9_]*(?==)", line))
    assert not words & _keywords(command), f"names an option as a keyword: {line}"
    assert not {w for w in re.findall(r"\b[a-z]+_[a-z_]+\b", line)} & _keywords(command), line
    assert "None" not in line and "hints=True" not in line, line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1, got 0"),
        (["run", "--prompt", ""], "--prompt must be a non-empty string, got ''"),
        (["run", "--repeat", "0"], "--repeat must be an int >= 1, got 0"),
        (
            ["run", "--prompt", "hi"],
            "--prompt applies to causal LMs and encoder-decoders; the built-in model is an encoder, which embeds sentences",
        ),
        (
            ["run", "--budget", "40MB", "--storage-dtype", "float16", "--offload", "disk"],
            "it cannot be combined with --storage-dtype, --offload; drop them, or restrict the planner with --allow",
        ),
        (
            ["run", "--allow", "disk"],
            "--allow=disk restricts the fit planner, which runs only with a budget; give --budget too",
        ),
        (["run", "--budget", "1.5XB"], "--budget='1.5XB' is not a size"),
        (["run", "--budget", "1MB", "--allow", "keep,tape"], "--allow='keep,tape' has 'tape', which is not accepted"),
        (["run", "--timeline", "memory.svg"], "--timeline='memory.svg' must end in .png"),
        (["run", "--model", "/nonexistent"], "--model='/nonexistent' is not a folder"),
        (["plan", "--batch", "0"], "--batch must be an int >= 1, got 0"),
        (["plan", "--seq", "100000"], "--seq=100000 is longer than the model takes: 512 (max_position_embeddings)"),
        (["fit", "--budget", "0"], "--budget='0' is not accepted"),
        (["fit", "--budget", "40MB", "--max-new-tokens", "3"], "--max-new-tokens applies to causal LMs"),
        (["fit", "--model", "/nonexistent", "--budget", "1MB"], "--model='/nonexistent' is not a folder"),
    ],
)
def test_a_message_names_options_as_typed(capsys, argv, expected):
    line = error_line(capsys, argv)
    assert line.startswith(f"tightfit {argv[0]}: error: ") and expected in line, line
    assert_speaks_the_command_line(line, argv[0])


def test_the_same_messages_name_keywords_from_python():
    from tightfit.app.run import RunOptions

    with pytest.raises(ValueError, match=r"^max_new_tokens must be an int >= 1 or None, got 0$"):
        RunOptions(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^allow='disk' restricts the fit planner, .*; give budget too$"):
        RunOptions(allow="disk")
    with pytest.raises(
        ValueError, match=r"cannot be combined with quant; drop it, or restrict the planner with allow$"
    ):
        RunOptions(budget="40MB", quant="nf4")


def test_spelling_helpers():
    assert (option("max_new_tokens"), assigned("budget", "1.7MB"), assigned("prompt", "a b")) == (
        "max_new_tokens",
        "budget='1.7MB'",
        "prompt='a b'",
    )
    with command_line():
        assert (option("max_new_tokens"), assigned("budget", "1.7MB"), assigned("prompt", "a b")) == (
            "--max-new-tokens",
            "--budget=1.7MB",
            "--prompt='a b'",
        )
    assert option("budget") == "budget"  # the context is left
    flags = {"budget": "--budget", "max_new_tokens": "--max-new-tokens"}
    assert (
        for_command_line("budget='1XB' is not a size; accepted: 1, 2 or None; a_budget=3, --budget=4", flags)
        == "--budget='1XB' is not a size; accepted: 1, 2; a_budget=3, --budget=4"
    )
    assert [size_at_least(n) for n in (999, 1000, 1_636_736, 22_082_672, 5 * 10**9 + 1)] == [
        "999",
        "1KB",
        "1.7MB",
        "22.1MB",
        "5.1GB",
    ]
    assert allow_text(None) is None and allow_text(Allow()) is None and allow_text(Allow(hints=False)) is None
    assert allow_text(Allow.parse("device")) == "device"
    assert allow_text(Allow.parse("disk,float8")) == "keep,float8,device,disk"


def tightfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tightfit.app.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_a_budget_nothing_meets_suggests_one_the_user_can_type_and_it_fits(tiny_llama, capsys):
    """The real command: the refusal names --budget and --allow as typed, and the budget it
    suggests, typed back as it is written (to the command's own parser, in this process), is met."""
    done = tightfit("fit", "--model", str(tiny_llama), "--budget", "100KB", "--allow", "keep,device")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("tightfit fit: error: --budget=100000 (97.7 KiB) cannot be met on cpu")
    assert "with --allow=keep,device is" in line and "or allow more than --allow=keep,device" in line
    assert_speaks_the_command_line(line, "fit")
    suggested = re.search(r"Give (--budget=\S+) or more", line).group(1)
    assert cli.main(["fit", "--model", str(tiny_llama), suggested, "--allow", "keep,device"]) == 0
    assert "fit plan: LlamaForCausalLM on cpu" in capsys.readouterr().out


def test_activations_that_dominate_are_explained_without_an_option_the_command_lacks(capsys):
    line = error_line(capsys, ["fit", "--budget", "1MB"])
    assert "dominated by activations and inputs" in line and "the run is eager" in line
    assert line.endswith("Give --budget=1.7MB or more")
    assert_speaks_the_command_line(line, "fit")


def test_fit_takes_model_as_run_and_plan_do_and_the_positional_still_works(tiny_llama, capsys):
    assert cli.main(["fit", "--model", str(tiny_llama), "--budget", "1GB", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and '"applies_nothing": true' in captured.out
    assert cli.main(["fit", str(tiny_llama), "--budget", "1GB", "--json"]) == 0  # the deprecated spelling
    captured = capsys.readouterr()
    assert '"applies_nothing": true' in captured.out
    assert captured.err == (
        f"tightfit fit: note: 'tightfit fit DIR' is deprecated; write 'tightfit fit --model {tiny_llama}'\n"
    )
    line = error_line(capsys, ["fit", str(tiny_llama), "--model", str(tiny_llama), "--budget", "1GB"])
    assert "the model folder is given twice" in line and "give it once, as --model DIR" in line
    usage = next(a for a in cli._parser()._actions if a.dest == "command").choices["fit"].format_help()
    assert "[--model DIR]" in usage and usage.count("DIR") == 2  # in the usage line and the help: no positional

"""bitsandbytes' own test suite against tightfit.compat.bitsandbytes, on this machine's CPU.

The same selection of bitsandbytes' tests runs twice, each file in its own pytest process:
once with the real bitsandbytes, once with ``bitsandbytes`` renamed to
``tightfit.compat.bitsandbytes`` by a shim conftest written into a temporary copy of the
tests (never into this repository). The table says, per file, how many tests the real
library passes and how many of those tightfit passes too, and groups the rest by cause.

The shim only renames; no bitsandbytes code runs under it. Its adapters:
  bitsandbytes, .nn, .functional   -> tightfit.compat.bitsandbytes, .nn, .functional
  bitsandbytes.nn.modules          -> tightfit.compat.bitsandbytes.nn (where bnb's classes live)
  bitsandbytes.nn.parametrize      -> tightfit.compat.bitsandbytes.nn.parametrize
  bitsandbytes.optim, .utils       -> tightfit.compat.bitsandbytes.optim, .utils
  bitsandbytes.cextension          -> a module holding HIP_ENVIRONMENT = False (tests/helpers.py
                                      imports it; the real value on a CPU machine)
  torch.ops.bitsandbytes           -> torch.ops.tightfit_bitsandbytes (bitsandbytes' op schemas on tightfit)
A meta-path blocker refuses every other ``bitsandbytes.*`` import, so a name tightfit lacks
fails as missing; at the end of each run the shim checks that no module of the real
package was imported and that no libbitsandbytes shared object is mapped into the process.

Run: python benchmarks/peer_suites.py --bnb-tests DIR [--per-file N] [--timeout S] [--keep OUT [--reuse]]
(DIR is bitsandbytes' tests/ folder; with --per-file N [FILE=N ...], a file with more tests
than N runs a deterministic sample of N: the ids with the smallest SHA-256, so a larger N
runs a superset. --reuse tabulates the records an earlier run left in --keep.)
The issue 15 figures: --per-file 35 test_functional.py=120 (about 7 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILES = (
    "test_functional.py",
    "test_linear4bit.py",
    "test_linear8bitlt.py",
    "test_modules.py",
    "test_autograd.py",
    "test_ops.py",
    "test_parametrize.py",
    "test_optim.py",
)

# Written at the root of the temporary copy; bitsandbytes' own tests/conftest.py stays as it is.
CONFTEST = r'''
import json
import os
import signal
import sys

import pytest

_RESULTS = os.environ.get("PEER_SUITE_RESULTS")
_SELECT = os.environ.get("PEER_SUITE_SELECT")
_TIMEOUT = int(os.environ.get("PEER_SUITE_TIMEOUT", "0"))
_SHIM = os.environ.get("PEER_SUITE_SHIM") == "tightfit"


def _write(record):
    if not _RESULTS:
        return
    with open(_RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")


if _SHIM:
    import importlib.abc
    import types

    import torch

    import tightfit.compat.bitsandbytes as _tf
    import tightfit.compat.bitsandbytes.nn.parametrize as _tf_parametrize

    class _Renamed(types.ModuleType):
        """A tightfit module under bitsandbytes' name, with the submodules bnb's tests reach."""

        def __init__(self, name, target, **submodules):
            super().__init__(name)
            self.__dict__.update(submodules)
            self._target = target

        def __getattr__(self, attr):
            return getattr(self._target, attr)

    _cext = types.ModuleType("bitsandbytes.cextension")
    _cext.HIP_ENVIRONMENT = False
    _nn = _Renamed("bitsandbytes.nn", _tf.nn, modules=_tf.nn, parametrize=_tf_parametrize)
    _root = _Renamed(
        "bitsandbytes", _tf, nn=_nn, functional=_tf.functional, cextension=_cext, optim=_tf.optim, utils=_tf.utils
    )
    _ALIASES = {
        "bitsandbytes": _root,
        "bitsandbytes.optim": _tf.optim,
        "bitsandbytes.optim.ademamix": _tf.optim.ademamix,
        "bitsandbytes.utils": _tf.utils,
        "bitsandbytes.nn": _nn,
        "bitsandbytes.nn.modules": _tf.nn,
        "bitsandbytes.nn.parametrize": _tf_parametrize,
        "bitsandbytes.functional": _tf.functional,
        "bitsandbytes.cextension": _cext,
    }

    class _BlockRealBitsandbytes(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] == "bitsandbytes" and fullname not in _ALIASES:
                raise ModuleNotFoundError(f"No module named {fullname!r} (not in tightfit.compat.bitsandbytes)")
            return None

    sys.meta_path.insert(0, _BlockRealBitsandbytes())
    sys.modules.update(_ALIASES)
    torch.ops.bitsandbytes = torch.ops.tightfit_bitsandbytes

    def pytest_sessionfinish(session):
        real = [
            name
            for name, mod in list(sys.modules.items())
            if "site-packages/bitsandbytes" in (getattr(mod, "__file__", None) or "")
        ]
        with open("/proc/self/maps") as f:
            native = sorted({line.split()[-1] for line in f if "libbitsandbytes" in line})
        _write({"guard": {"real_modules": real, "native_libraries": native}})


if _SELECT:

    def pytest_collection_modifyitems(config, items):
        with open(_SELECT) as f:
            wanted = set(f.read().split("\n"))
        keep = [item for item in items if item.nodeid in wanted]
        dropped = [item for item in items if item.nodeid not in wanted]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _timeout(signum, frame):
    raise TimeoutError(f"over the per-test limit of {_TIMEOUT} s")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _TIMEOUT:
        signal.signal(signal.SIGALRM, _timeout)
        signal.alarm(_TIMEOUT)
    try:
        return (yield)
    finally:
        signal.alarm(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.exc_type = call.excinfo.typename if call.excinfo else ""
    return report


def _test_frame(longrepr):
    """The failing line of the test's own frame, and whether it sits inside a ``pytest.raises`` block."""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    lines = (getattr(entries[0], "lines", None) or []) if entries else []
    marks = [i for i, line in enumerate(lines) if line.startswith(">")]
    if not marks:
        return "", False
    fail = lines[marks[0]][1:]
    indent = len(fail) - len(fail.lstrip())
    for line in reversed(lines[: marks[0]]):
        text = line[1:]
        if text.strip() and len(text) - len(text.lstrip()) < indent and "pytest.raises" in text:
            return fail.strip(), True
    return fail.strip(), False


def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.failed or report.skipped):
        return
    record = {"id": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.skipped and isinstance(report.longrepr, tuple):
        record["message"] = str(report.longrepr[2])[:300]
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        record["message"] = (crash.message if crash else str(report.longrepr))[:600]
        record["path"] = crash.path if crash else ""
        record["type"] = getattr(report, "exc_type", "")
        record["line"], record["in_raises"] = _test_frame(report.longrepr)
    _write(record)


def pytest_collectreport(report):
    if report.failed:
        _write({"id": report.nodeid, "when": "collect", "outcome": "error", "message": str(report.longrepr)[-600:]})
'''

PYTEST_INI = """[pytest]
addopts = -p no:cacheprovider -m "not slow and not benchmark and not deprecated"
markers =
    benchmark: mark test as a benchmark
    deprecated: mark test as covering a deprecated feature
    slow: mark test as slow
testpaths = tests
"""


def _pytest(root: Path, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def _collect(root: Path, name: str, env: dict[str, str]) -> list[str]:
    """Test ids of one file, collected with the real bitsandbytes."""
    done = _pytest(root, ["--co", f"tests/{name}"], env, timeout=300)
    return [line for line in done.stdout.splitlines() if line.startswith(f"tests/{name}::")]


def _sample(ids: list[str], per_file: int | None) -> list[str]:
    if per_file is None or len(ids) <= per_file:
        return ids
    chosen = set(sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:per_file])
    return [i for i in ids if i in chosen]


def _run(root: Path, name: str, mode: str, ids: list[str], env: dict[str, str], args) -> float:
    """Run one file's selected tests in one mode; the records go to ``--keep``/mode/name.jsonl."""
    out = args.keep / mode
    out.mkdir(parents=True, exist_ok=True)
    select = out / f"{name}.select"
    select.write_text("\n".join(ids))
    results = out / f"{name}.jsonl"
    results.unlink(missing_ok=True)
    run_env = dict(env, PEER_SUITE_RESULTS=str(results), PEER_SUITE_SELECT=str(select))
    run_env["PEER_SUITE_TIMEOUT"] = str(args.timeout)
    if mode == "tightfit":
        run_env["PEER_SUITE_SHIM"] = "tightfit"
    start = time.perf_counter()
    try:
        done = _pytest(root, [f"tests/{name}", f"--junitxml={out / name}.xml"], run_env, args.file_timeout)
        (out / f"{name}.log").write_text(done.stdout[-200_000:] + done.stderr[-50_000:])
    except subprocess.TimeoutExpired:
        (out / f"{name}.log").write_text(f"killed after {args.file_timeout} s")
    return time.perf_counter() - start


def _read(out: Path, name: str) -> dict:
    """Outcome per test id (a teardown error overrides a pass), and the shim's guard record."""
    outcomes: dict = {}
    results = out / f"{name}.jsonl"
    for line in results.read_text().splitlines() if results.exists() else []:
        record = json.loads(line)
        if "guard" in record:
            outcomes["__guard__"] = record["guard"]
            continue
        previous = outcomes.get(record["id"])
        if previous is None or previous["outcome"] == "passed":
            outcomes[record["id"]] = record
    return outcomes


_MISSING = re.compile(r"attribute '(\w+)'|named '([\w.]+)'|import name '(\w+)'|name '(\w+)' is not defined")
_SIGNATURE = re.compile(r"unexpected keyword argument|positional argument|required argument|got multiple values")
_NUMERIC = re.compile(r"not close|Mismatched elements|isclose|allclose|assert_close|atol|rtol|err|diff|abs\(|numel")


def _in_tightfit(record: dict) -> bool:
    return f"{os.sep}tightfit{os.sep}" in record.get("path", "")


def categorize(record: dict | None) -> str:
    """The cause of a failure with tightfit, for a test the real library passes."""
    if record is None:
        return "not run (its process died or ran out of time)"
    message = record.get("message", "")
    kind = record.get("type") or message.split(":", 1)[0].strip()
    missing = _MISSING.search(message)
    if record["when"] == "collect" or (missing and not _in_tightfit(record)):
        return "missing name"
    if kind == "TimeoutError":
        return "over the time limit"
    if "DID NOT RAISE" in message:
        return "no error where bitsandbytes raises"
    if "DID NOT WARN" in message:
        return "no warning where bitsandbytes warns"
    if record.get("in_raises"):
        return "different error type"
    if kind == "TypeError" and _SIGNATURE.search(message):
        return "different signature"
    if kind == "RuntimeError" and "tightfit::" in message:
        return "different op schema"
    if kind in ("ValueError", "TypeError") and _in_tightfit(record):
        return "input refused by tightfit's checks"
    if _in_tightfit(record):
        return f"error inside tightfit ({kind})"
    if kind == "AssertionError" and "caplog" in record.get("line", ""):
        return "different log message"
    if kind == "AssertionError" and _NUMERIC.search(message + record.get("line", "")):
        return "numerical difference"
    if kind == "AssertionError":
        return "behaviour difference (assertion)"
    return f"other error ({kind or 'unknown'})"


def missing_names(messages: list[str]) -> collections.Counter:
    """How often each missing name appears, for the "missing name" category."""
    names = collections.Counter()
    for message in messages:
        found = _MISSING.search(message)
        names[next((g for g in found.groups() if g), "?") if found else "?"] += 1
    return names


def _per_file(values: list[str]) -> dict[str, int | None]:
    """``--per-file N FILE=N ...``: a default sample size and sizes for named files."""
    sizes: dict[str, int | None] = {"": None}
    for value in values:
        name, _, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--per-file {value!r}: expected a positive count N or FILE=N")
        sizes[name] = int(count)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bnb-tests", type=Path, required=True, help="bitsandbytes' tests/ folder")
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--per-file", nargs="+", default=[], help="sample at most N tests per file (or FILE=N)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--file-timeout", type=int, default=900, help="seconds per file and mode")
    parser.add_argument("--keep", type=Path, default=None, help="folder for the junit XML, logs and records")
    parser.add_argument("--reuse", action="store_true", help="tabulate the records in --keep; run nothing")
    parser.add_argument("--examples", type=int, default=2, help="examples printed per category")
    args = parser.parse_args()
    if not (args.bnb_tests / "conftest.py").is_file() or not (args.bnb_tests / "helpers.py").is_file():
        parser.error(f"--bnb-tests {args.bnb_tests}: expected bitsandbytes' tests/ folder (conftest.py, helpers.py)")
    try:
        sizes = _per_file(args.per_file)
    except ValueError as e:
        parser.error(str(e))

    if args.reuse and args.keep is None:
        parser.error("--reuse needs --keep: the folder of an earlier run's records")
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as tmp:
        root = Path(tmp)
        shutil.copytree(args.bnb_tests, root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "conftest.py").write_text(CONFTEST)
        (root / "pytest.ini").write_text(PYTEST_INI)
        kept = "" if args.keep is None else f"; records in {args.keep.resolve()}"
        args.keep = (args.keep or root / "out").resolve()
        env = dict(os.environ, BNB_TEST_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))

        rows, failures, guards = [], collections.defaultdict(list), []
        for name in args.files:
            meta = args.keep / f"{name}.meta.json"
            if not args.reuse:
                collected = _collect(root, name, env)
                ids = _sample(collected, sizes.get(name, sizes[""]))
                seconds = [_run(root, name, mode, ids, env, args) for mode in ("real", "tightfit")]
                meta.write_text(json.dumps({"collected": len(collected), "ids": ids, "seconds": seconds}))
            run = json.loads(meta.read_text())
            ids, (real_s, shim_s) = run["ids"], run["seconds"]
            real, shim = _read(args.keep / "real", name), _read(args.keep / "tightfit", name)
            guards.append((name, shim.pop("__guard__", None)))
            passed = [i for i in ids if real.get(i, {}).get("outcome") == "passed"]
            both = [i for i in passed if shim.get(i, {}).get("outcome") == "passed"]
            extra = [i for i in ids if shim.get(i, {}).get("outcome") == "passed" and i not in passed]
            collect_error = shim.get(f"tests/{name}")
            for i in passed:
                if i not in both:
                    record = shim.get(i) or collect_error
                    failures[categorize(record)].append((i, (record or {}).get("message", "")))
            rows.append((name, run["collected"], len(ids), len(passed), len(both), len(extra), real_s, shim_s))

    print(f"\nbitsandbytes tests on the CPU, per-test limit {args.timeout} s{kept}")
    head = ("file", "collected", "run", "real passes", "tightfit too", "tightfit only", "real s", "tightfit s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, collected, run, passed, both, extra, real_s, shim_s in rows:
        print(f"| {name} | {collected} | {run} | {passed} | {both} | {extra} | {real_s:.0f} | {shim_s:.0f} |")
    total = [sum(r[k] for r in rows) for k in (1, 2, 3, 4, 5)]
    print(f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]} | {total[4]} | | |")
    print("\nPassed with the real library, failed with tightfit, by cause:")
    for cause, items in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        print(f"- {cause}: {len(items)}")
        if cause == "missing name":
            names = missing_names([message for _, message in items])
            print("    names: " + ", ".join(f"{name} ({count})" for name, count in names.most_common()))
        tests = collections.Counter(test_id.split("[")[0].rpartition("::")[2] for test_id, _ in items)
        print("    tests: " + ", ".join(f"{test} ({count})" for test, count in tests.most_common()))
        for test_id, message in items[: args.examples]:
            print(f"    {test_id}\n      {message.splitlines()[0][:200] if message else ''}")
    for name, guard in guards:
        if guard is None:
            print(f"shim guard: {name}: no record (the tightfit run did not finish)")
        elif guard["real_modules"] or guard["native_libraries"]:
            sys.exit(f"shim guard: {name}: the real bitsandbytes ran under the shim: {guard}")
        else:
            print(f"shim guard: {name}: no module of the real bitsandbytes imported, no libbitsandbytes loaded")


if __name__ == "__main__":
    main()

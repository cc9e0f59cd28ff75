"""Mutation testing: does the fast suite notice plausible one-line bugs?

Each mutant is applied alone to a private copy of the repository (the working
tree is never written, so it can run beside other work), then the fast tests
of the mutated module run there with ``-x``; the mutant is killed when one
fails (or when the run times out: an endless loop counts as noticed).

  hand  HAND (in mutation_tables.py, with TESTS and EQUIVALENT): one-line bugs
        an engineer could plausibly write, each with the test meant to catch it.
        The figure the suite is held to (>= 95%).
  auto  operators applied by an AST walk to every module of infer/core,
        infer/primitives and infer/backends/cpu_ref: comparison and boundary
        flips, arithmetic swaps, off-by-one constants, and/or, dropped `not`,
        True/False, min/max, a deleted call statement, break/continue. A
        seeded sample per module; EQUIVALENT lists survivors that cannot be
        killed, with the reason, and they leave the rate (target >= 90%).

Run locally, not in CI (minutes to an hour); nice it, the tests are CPU-bound:

  nice -n 10 .venv/bin/python tools/mutation.py hand
  nice -n 10 .venv/bin/python tools/mutation.py auto --per-module 4 --budget-s 2400 --json /tmp/m.json
  nice -n 10 .venv/bin/python tools/mutation.py auto --rerun /tmp/m.json   # its survivors, after new tests
  .venv/bin/python tools/mutation.py auto --module infer/core/detokenizer.py --per-module 0  # all of one
  .venv/bin/python tools/mutation.py list infer/core/scheduler.py   # its mutants, not run

Tests run in forked children of a process that has imported torch and the
other heavy dependencies but never `infer`, so each mutant costs its tests,
not a 3-second start-up; PYTHONPATH points at the copy so subprocesses (the
server tests' `infer serve`) run the mutant too.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mutation_tables import ENGINE, EQUIVALENT, HAND, TESTS, TOO_SLOW  # beside this script: on sys.path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("infer/core", "infer/primitives", "infer/backends/cpu_ref")
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "--hypothesis-seed=0", "-W", "ignore",
               *(f"--deselect={t}" for t in TOO_SLOW)]


def tests_for(path: str) -> list[str]:
    if path in TESTS:
        return TESTS[path]
    folder = max((k for k in TESTS if k.endswith("/") and path.startswith(k)), key=len, default=None)
    return TESTS[folder] if folder else ENGINE




@dataclass
class Mutant:
    id: str
    path: str
    line: int
    before: str  # the source line(s) it changes, stripped
    after: str
    source: str = field(repr=False, default="")  # the whole mutated file


@dataclass
class Result:
    mutant: str
    path: str
    line: int
    before: str
    after: str
    status: str  # killed | survived | timeout | equivalent | stale
    seconds: float
    reason: str = ""
    killed_by: str = ""  # the first failing test


# -- AST operators ------------------------------------------------------------------------------------------
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv}


LOGGERS = ("log", "logger", "logging", "warnings")


def _skipped_spans(tree: ast.AST) -> list[tuple[int, int]]:
    """Line spans whose mutants only change messages or typing: raise, assert, logging, docstrings, annotations."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.Assert)):
            spans.append((node.lineno, node.end_lineno))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            spans.append((node.lineno, node.end_lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in LOGGERS:
            spans.append((node.lineno, node.end_lineno))
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            spans.append((node.lineno, node.end_lineno))
    return spans


def _variants(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(mutated copy of `node`, operator name) for every operator that applies to it."""
    out = []

    def copy():
        return ast.parse(ast.unparse(node), mode="eval").body if isinstance(node, ast.expr) else None

    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP:
                m = copy()
                m.ops[i] = _CMP[type(op)]()
                out.append((m, "compare"))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        m = copy()
        m.op = _BIN[type(node.op)]()
        out.append((m, "arith"))
    elif isinstance(node, ast.BoolOp):
        m = copy()
        m.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append((m, "boolop"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append((copy().operand, "not"))
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append((ast.Constant(not node.value), "bool"))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        out.append((ast.Constant(node.value + 1), "const"))
        if node.value != 0:
            out.append((ast.Constant(node.value - 1), "const"))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        m = copy()
        m.func.id = "max" if node.func.id == "min" else "min"
        out.append((m, "minmax"))
    return out


def generate(path: str, source: str | None = None) -> list[Mutant]:
    """Every auto mutant of one file, in source order."""
    source = source if source is not None else (ROOT / path).read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    skipped = _skipped_spans(tree)
    untouched = set()  # annotations, f-strings, decorators: mutants there change no behaviour worth a test
    for node in ast.walk(tree):
        parts = [getattr(node, "annotation", None), getattr(node, "returns", None)]
        parts += [node] if isinstance(node, ast.JoinedStr) else []
        parts += getattr(node, "decorator_list", [])
        untouched |= {id(n) for part in parts if isinstance(part, ast.AST) for n in ast.walk(part)}
    mutants = []

    def splice(node: ast.AST, text: str) -> Mutant:
        def at(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
            return offsets[line - 1] + len(lines[line - 1].encode()[:col].decode())

        start, end = at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)
        new = source[:start] + text + source[end:]
        first, last = offsets[node.lineno - 1], offsets[node.end_lineno]  # the whole lines the node is on
        before, after = source[first:last], new[first:last + len(text) - (end - start)]
        return Mutant("", path, node.lineno, " ".join(before.split()), " ".join(after.split()), new)

    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or id(node) in untouched:
            continue
        if any(a <= node.lineno <= b for a, b in skipped):
            continue
        for variant, _ in _variants(node):
            mutants.append(splice(node, ast.unparse(variant)))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            mutants.append(splice(node, "pass"))
        elif isinstance(node, (ast.Break, ast.Continue)):
            mutants.append(splice(node, "continue" if isinstance(node, ast.Break) else "break"))
    mutants.sort(key=lambda m: (m.line, m.after))
    unique, seen = [], set()
    for m in mutants:
        if m.source != source and m.source not in seen:
            seen.add(m.source)
            unique.append(m)
    stem = path.removeprefix("infer/").removesuffix(".py").replace("/", ".")
    for i, m in enumerate(unique):
        m.id = f"{stem}#{i}"
    return unique


def modules(selected: list[str] | None) -> list[str]:
    if selected:
        return selected
    found = []
    for pkg in PACKAGES:
        found += sorted(str(p.relative_to(ROOT)) for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py")
    return found


# -- running ------------------------------------------------------------------------------------------------
class Sandbox:
    """A private copy of the repository's code and tests, restored after each mutant."""

    def __init__(self):
        self.killer = ""  # the first failing test of the latest run
        self.dir = Path(tempfile.mkdtemp(prefix="infer-mutation-"))
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
        for name in ("infer", "tests", "benchmarks", "examples"):
            if (ROOT / name).exists():
                shutil.copytree(ROOT / name, self.dir / name, ignore=ignore)
        shutil.copy(ROOT / "pyproject.toml", self.dir)

    def run(self, tests: list[str], timeout: float, mutated: tuple[str, str] | None = None) -> tuple[str, float]:
        """('killed' | 'survived' | 'timeout', seconds) of the tests with one file replaced."""
        original = None
        if mutated:
            target = self.dir / mutated[0]
            original = target.read_text()
            target.write_text(mutated[1])
        try:
            return self._fork_pytest(tests, timeout)
        finally:
            if mutated:
                (self.dir / mutated[0]).write_text(original)

    def _fork_pytest(self, tests: list[str], timeout: float) -> tuple[str, float]:
        start = time.time()
        log = self.dir / "last-run.log"
        pid = os.fork()
        if pid == 0:  # the child: run pytest on the copy and leave
            try:
                os.setpgid(0, 0)
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(self.dir)
                sys.path.insert(0, str(self.dir))
                sys.dont_write_bytecode = True  # a stale .pyc of the same size and second would hide a mutant
                os.environ["PYTHONPATH"] = str(self.dir)
                os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
                import pytest

                code = pytest.main([*PYTEST_ARGS, *tests])
                os._exit(int(code))
            except BaseException:
                os._exit(99)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.time() - start > timeout:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout", time.time() - start
            time.sleep(0.05)
        code = os.waitstatus_to_exitcode(status)
        failed = [line for line in log.read_text().splitlines() if line.startswith(("FAILED ", "ERROR "))]
        self.killer = failed[0].split(" - ")[0].split(" ", 1)[1] if failed else ""
        if code not in (0, 1):  # 2: interrupted, 3: internal error, 4: usage, 5: no tests: not a verdict
            text = log.read_text()[-3000:]
            if code == 2 and "Interrupted" in text and "error" in text.lower():
                return "killed", time.time() - start  # a collection error: the mutant breaks an import
            raise RuntimeError(f"pytest exited {code} on {tests}:\n{text}")
        return ("survived" if code == 0 else "killed"), time.time() - start

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def prewarm() -> None:
    """Import the heavy dependencies once, before forking (never `infer`: each child imports its mutant)."""
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    for name in ("hypothesis", "fastapi", "httpx", "openai", "tokenizers", "safetensors", "gguf", "pluggy"):
        try:
            __import__(name)
        except ImportError:
            pass
    assert "infer" not in sys.modules


def baseline(box: Sandbox, tests: list[str], cache: dict) -> tuple[list[str], float]:
    """The pytest arguments each mutant of these test files runs, and their time unmutated.

    Each file is run once, alone, and cached. A test failing without a mutant
    (broken, or flaky under load) is deselected, with a warning."""
    args, total = [], 0.0
    for path in tests:
        if path not in cache:
            deselect = []
            for _ in range(5):
                status, seconds = box.run([path, *deselect], timeout=1800)
                if status == "survived" or not box.killer:
                    break
                print(f"warning: {box.killer} fails without a mutant: deselected", flush=True)
                if box.killer == path:  # the one test named here: nothing is left to run
                    break
                deselect.append(f"--deselect={box.killer}")
            cache[path] = ([path, *deselect], seconds) if status == "survived" else ([], 0.0)
        args += cache[path][0]
        total += cache[path][1]
    return args, total


def run_hand(args) -> list[Result]:
    box, results, times = Sandbox(), [], {}
    try:
        for mid, path, text, repl, what, guard in HAND:
            source = (ROOT / path).read_text()
            if source.count(text) != 1:
                results.append(Result(mid, path, 0, text, repl, "stale", 0.0, "text not found once: update HAND"))
                print(f"{mid:28} stale (text not found once in {path})", flush=True)
                continue
            tests, base = baseline(box, [guard] if args.guard_only else tests_for(path), times)
            if not tests:
                results.append(Result(mid, path, 0, text, repl, "stale", 0.0, "its tests fail unmutated"))
                continue
            status, seconds = box.run(tests, 3 * base + 30, (path, source.replace(text, repl)))
            line = source[:source.index(text)].count("\n") + 1
            results.append(Result(mid, path, line, text.strip(), repl.strip(), status, seconds, what, box.killer))
            print(f"{mid:26} {status:8} {seconds:5.1f}s  {path}:{line}  {what}; {box.killer or '-'}", flush=True)
    finally:
        box.close()
    return results


def run_auto(args) -> list[Result]:
    """Sampled mutants, round-robin over the modules so a spent budget still leaves every module measured."""
    rng = random.Random(args.seed)
    queues = []
    if args.rerun:  # the survivors of an earlier report, found again by their lines in today's source
        wanted = [r for r in json.loads(args.rerun.read_text()) if r["status"] == "survived"]
        for path in sorted({r["path"] for r in wanted}):
            keys = {(r["before"], r["after"]) for r in wanted if r["path"] == path}
            queues.append([m for m in generate(path) if (m.before, m.after) in keys])
    for path in [] if args.rerun else modules(args.module):
        mutants = generate(path)
        if args.per_module and len(mutants) > args.per_module:
            mutants = sorted(rng.sample(mutants, args.per_module), key=lambda m: m.line)
        queues.append(mutants)
    order = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    box, results, times = Sandbox(), [], {}
    deadline = time.time() + args.budget_s
    try:
        for n, m in enumerate(order):
            if time.time() > deadline:
                print(f"budget spent: {len(order) - n} mutants not run", flush=True)
                break
            why = EQUIVALENT.get((m.path, m.before, m.after))
            tests, base = baseline(box, tests_for(m.path), times)
            if why:
                results.append(Result(m.id, m.path, m.line, m.before, m.after, "equivalent", 0.0, why))
            elif not tests:
                results.append(Result(m.id, m.path, m.line, m.before, m.after, "stale", 0.0, "no passing tests"))
            else:
                status, seconds = box.run(tests, 3 * base + 30, (m.path, m.source))
                results.append(Result(m.id, m.path, m.line, m.before, m.after, status, seconds, "", box.killer))
                print(f"{m.id:34} {status:9} {seconds:6.1f}s  {m.path}:{m.line}: {m.after[:90]}", flush=True)
            if args.json:  # as it goes, so an interrupted run keeps what it measured
                args.json.write_text(json.dumps([asdict(r) for r in results], indent=1, ensure_ascii=False))
    finally:
        box.close()
    return results


def report(results: list[Result]) -> str:
    by_module: dict[str, list[Result]] = {}
    for r in results:
        by_module.setdefault(r.path, []).append(r)
    lines = [f"{'module':44} {'killed':>7} {'of':>4} {'rate':>6}  (equivalent, stale)"]
    total_k = total_n = 0
    for path, rs in sorted(by_module.items()):
        counted = [r for r in rs if r.status in ("killed", "timeout", "survived")]
        k = sum(r.status != "survived" for r in counted)
        total_k, total_n = total_k + k, total_n + len(counted)
        rate = f"{100 * k / len(counted):5.1f}%" if counted else "   -  "
        extra = sum(r.status == "equivalent" for r in rs), sum(r.status == "stale" for r in rs)
        lines.append(f"{path:44} {k:7} {len(counted):4} {rate}  {extra}")
    if total_n:
        lines.append(f"{'all':44} {total_k:7} {total_n:4} {100 * total_k / total_n:5.1f}%")
    survivors = [r for r in results if r.status == "survived"]
    if survivors:
        lines.append("\nsurvivors (kill each with a test, or add it to EQUIVALENT with the reason):")
        lines += [f"  {r.mutant:34} {r.path}:{r.line}\n      - {r.before[:110]}\n      + {r.after[:110]}"
                  for r in survivors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    hand = sub.add_parser("hand", help="the hand-made mutants")
    hand.add_argument("--guard-only", action="store_true", help="run only the test meant to catch each mutant")
    auto = sub.add_parser("auto", help="AST mutants of infer/core, infer/primitives, infer/backends/cpu_ref")
    auto.add_argument("--module", action="append", help="only this file (repeatable)")
    auto.add_argument("--per-module", type=int, default=6, help="sampled mutants per module; 0: all")
    auto.add_argument("--seed", type=int, default=0)
    auto.add_argument("--budget-s", type=float, default=2400, help="start no mutant after this many seconds")
    auto.add_argument("--rerun", type=Path, help="only the survivors of this earlier --json report")
    lst = sub.add_parser("list", help="print a file's auto mutants without running them")
    lst.add_argument("path")
    for p in (hand, auto):
        p.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for m in generate(args.path):
            print(f"{m.id:34} line {m.line}: {m.after[:100]}")
        return 0
    prewarm()
    results = run_hand(args) if args.cmd == "hand" else run_auto(args)
    print("\n" + report(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

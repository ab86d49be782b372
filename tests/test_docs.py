"""The docs cannot rot silently: every flag a docs table names exists in that script's parser with the stated
default, every command in a code block parses (Accelerate's own launcher parser for the launcher's part, the
script's own parser for the rest), every test a doc cites exists, every relative link and anchor resolves, and the
README stays a front page. Unit checks: no training runs here (the replay commands run in test_checkpoint.py)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.launch import launch_command_parser
from conftest import REPO

from utils.cli import FlagParser

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT = re.compile(r"\b(train_cifar|train_vit|train_minimal)\.py\b")
REPO_PATH = re.compile(r"`((?:tests|utils|bench|slurm|accelerate_configs|notebooks|docs|\.ci)/[\w./-]+)`")
MADE_AT_RUN_TIME = (".gpu-kit/", "runs/", "OUT/")  # paths a command in the docs creates before it uses them


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def fenced(text: str, languages: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, content) of every code block in one of `languages`."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if opening:
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            if opening[1] in languages:
                blocks.append((i + 2, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return blocks


def prose(text: str) -> str:
    """The text outside code blocks (each block's lines blanked, so line numbers stay)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


INLINE_COMMAND = re.compile(r"`((?:accelerate launch|python3?|sbatch|bash|pip install) [^`]+)`")


def doc_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for each logical line of the file's bash blocks (continuations joined, comment lines out),
    and each inline code span outside them that starts like a command (`accelerate launch ...` in a table)."""
    text = prose(path.read_text())
    found = [(text.count("\n", 0, m.start()) + 1, " ".join(m[1].split())) for m in INLINE_COMMAND.finditer(text)]
    for start, block in fenced(path.read_text(), ("bash",)):
        logical, first = "", None
        for offset, line in enumerate(block.splitlines()):
            if first is None:
                first = start + offset
            logical += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                if logical.strip() and not logical.lstrip().startswith("#"):
                    found.append((first, logical.strip()))
                logical, first = "", None
    return found


class _Parsed(BaseException):  # not an Exception: the scripts' own error handling must not catch it
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        super().__init__()
        self.parser, self.namespace = parser, namespace


_PARSE_ARGS = argparse.ArgumentParser.parse_args
_FLAG_PARSE_ARGS = FlagParser.parse_args  # the scripts' parser (utils/cli.py): argparse's, with --config and its errors


def parse_only(script: Path, argv: list[str]) -> tuple[argparse.ArgumentParser | None, object]:
    """Runs `python script argv` until its first `parse_args` has parsed, then stops it there: (parser, namespace),
    or (None, the parser's last error line) when the command line is rejected, or (None, 'help') after --help."""
    def stop(self, args=None, namespace=None):
        raise _Parsed(self, _PARSE_ARGS(self, args, namespace))

    def stop_flags(self, args=None, namespace=None):
        raise _Parsed(self, _FLAG_PARSE_ARGS(self, args, namespace))

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
            mock.patch.object(FlagParser, "parse_args", stop_flags), \
            mock.patch.object(sys, "argv", [str(script), *argv]), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Parsed as parsed:
            return parsed.parser, parsed.namespace
        except SystemExit as e:
            return None, "help" if e.code == 0 else (err.getvalue().strip().splitlines() or ["exit"])[-1]
    return None, "the script never parsed a command line"


def check_script(script: str, argv: list[str]) -> str | None:
    path = REPO / script
    if not path.is_file():
        return f"{script} does not exist"
    parser, result = parse_only(path, argv)
    return None if parser is not None or result == "help" else f"{script} rejects {shlex.join(argv)}: {result}"


def shell_words(command: str) -> list[list[str]]:
    """The simple commands of one line: split at && ; | and the words of a for loop's body, variables set to 1."""
    words = shlex.split(re.sub(r"\$\{?\w+\}?", "1", command), comments=True)
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        elif word.endswith(";"):
            current.append(word[:-1])
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    out = []
    for c in commands:
        while c and c[0] in ("do", "then"):
            c = c[1:]
        if c and c[0] not in ("for", "done", "fi", "cd", "export"):
            out.append(c)
    return out


def check_path(path: str) -> str | None:
    if path.startswith(MADE_AT_RUN_TIME) or (path.startswith("../") and not (REPO / path.split("/")[1]).exists()):
        return None
    return None if (REPO / path).exists() else f"{path} does not exist"


def check_command(words: list[str]) -> str | None:
    """None if the command parses; else what is wrong. Commands of other tools (wandb, git, ...) pass unchecked."""
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words:
        return None
    tool, rest = words[0], words[1:]
    if tool in ("python", "python3"):
        if rest[:1] == ["-m"]:
            return next((check_path(w) for w in rest[2:] if w.startswith("tests/") and check_path(w)), None)
        return check_script(rest[0], rest[1:])
    if tool == "accelerate" and rest[:1] == ["launch"]:
        error = io.StringIO()
        with contextlib.redirect_stderr(error):
            try:
                launch = launch_command_parser().parse_args(rest[1:])
            except SystemExit:
                return f"accelerate launch rejects it: {error.getvalue().strip().splitlines()[-1]}"
        if launch.config_file and check_path(launch.config_file):
            return check_path(launch.config_file)
        return check_script(launch.training_script, launch.training_script_args)
    if tool == "sbatch":
        batch = next((i for i, w in enumerate(rest) if w.endswith(".sbatch")), None)
        if batch is None:
            return "sbatch without a batch script"
        if rest[batch].endswith("sweep_agents.sbatch"):  # its arguments go to `wandb agent`
            return check_path(rest[batch])
        return check_path(rest[batch]) or check_script(env.get("SCRIPT", "train_cifar.py"), rest[batch + 1:])
    if tool == "bash":
        if rest[0] == "bench/gpu_check.sh":
            return check_script("bench/gpu_check.py", rest[1:])
        return check_path(rest[0])
    if tool == "pip":
        return next((check_path(rest[i + 1]) for i, w in enumerate(rest) if w == "-r" and check_path(rest[i + 1])),
                    None)
    return None


def flag_tables(path: Path):
    """(line, script, flags, default cell) for each row of a table headed `flag | default | ...`; the script is the
    one the nearest heading above names."""
    script, lines = None, path.read_text().splitlines()
    in_code = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if line.startswith("#"):
            named = SCRIPT.search(line)
            script = named[0] if named else script if line.startswith("###") else None
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[:2] == ["flag", "default"] and lines[i + 1].startswith("|---"):
            row = i + 2
            while row < len(lines) and lines[row].startswith("|"):
                body = [c.strip() for c in lines[row].strip().strip("|").split("|")]
                yield row + 1, script, re.findall(r"`(--[\w-]+)`", body[0]), body[1]
                row += 1


def expected_default(cell: str):
    """The value a docs table's default cell states: unset/all -> None, off/on -> bool, `x` -> 'x', else a number."""
    word = cell.split()[0] if cell.split() else ""
    if word in ("unset", "all"):
        return None
    if word in ("off", "on"):
        return word == "on"
    quoted = re.match(r"`([^`]*)`", cell)
    return quoted[1] if quoted else float(word.replace(",", ""))


def same_default(actual, stated) -> bool:
    if stated is None or isinstance(stated, bool):
        return actual is stated
    if isinstance(stated, str):
        return str(actual) == stated
    return not isinstance(actual, bool) and isinstance(actual, int | float) and float(actual) == stated


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(path.read_text()).splitlines():
        heading = re.match(r"^#+\s+(.*)$", line)
        if heading:
            base = slug(heading[1])
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def defined_tests() -> set[str]:
    return {m for f in (REPO / "tests").glob("*.py") for m in re.findall(r"^\s*def (test_\w+)", f.read_text(), re.M)}


# ----------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_flag_a_docs_table_names_exists_with_the_stated_default(doc):
    parsers, problems, rows = {}, [], 0
    for line, script, flags, cell in flag_tables(doc):
        if script is None:
            problems.append(f"line {line}: a flag table under a heading that names no script")
            continue
        if script not in parsers:
            parsers[script] = parse_only(REPO / script, [])
        parser, defaults = parsers[script]
        for flag in flags:
            rows += 1
            action = parser._option_string_actions.get(flag)
            if action is None:
                problems.append(f"line {line}: {script} has no {flag}")
            elif not same_default(getattr(defaults, action.dest), expected_default(cell)):
                problems.append(f"line {line}: {script} {flag} defaults to {getattr(defaults, action.dest)!r}, "
                                f"the table says {cell!r}")
    assert not problems, "\n".join(problems)
    if doc.name in ("README.md", "flags.md"):
        assert rows >= 10, f"{rel(doc)}: {rows} flags found in its tables: the table format changed?"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_in_a_code_block_parses(doc):
    problems = [f"line {line}: {why}\n    {command}" for line, command in doc_commands(doc)
                for words in shell_words(command) if (why := check_command(list(words)))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_python_block_compiles(doc):
    for line, block in fenced(doc.read_text(), ("python",)):
        compile(block, f"{rel(doc)}:{line}", "exec")


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_test_a_doc_cites_exists_and_every_repository_path_too(doc):
    text, known = doc.read_text(), defined_tests()
    cited = set(re.findall(r"(?<![\w/])(test_\w+)(?![\w.])", text))
    assert not cited - known, f"{rel(doc)} cites tests that do not exist: {sorted(cited - known)}"
    missing = sorted({p for p in REPO_PATH.findall(text) if check_path(p.rstrip("."))})
    assert not missing, f"{rel(doc)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_and_anchor_resolves(doc):
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(doc.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        where = (doc.parent / file).resolve() if file else doc
        if not where.exists():
            problems.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            problems.append(f"{target}: {where.name} has no heading #{anchor}")
    assert not problems, f"{rel(doc)}: " + "; ".join(problems)


def test_the_flags_page_lists_every_option_of_train_cifar_and_train_minimal():
    listed = {}
    for _, script, flags, _ in flag_tables(REPO / "docs" / "flags.md"):
        listed.setdefault(script, set()).update(flags)
    for script in ("train_cifar.py", "train_minimal.py"):
        parser, _ = parse_only(REPO / script, [])
        options = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
        assert options <= listed[script], f"docs/flags.md lacks {script}'s {sorted(options - listed[script])}"


def help_text(parser, flag: str) -> str:
    """The flag's help as --help prints it, without argparse's " (default: ...)" suffix, whitespace collapsed."""
    action = parser._option_string_actions[flag]
    text = " ".join(parser._get_formatter()._expand_help(action).split())
    return re.sub(r" \(default: [^()]*\)$", "", text)


def meaning(cell: str) -> str:
    """A flags table's meaning cell as plain text: links to other pages dropped, backticks removed."""
    cell = re.sub(r" ?\(\[[^\]]*\]\([^)]*\)\)", "", cell)
    return " ".join(cell.replace("`", "").split())


def without_asides(text: str) -> str:
    """The text without its parenthesised asides (nested ones included) and the space before each."""
    kept, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return " ".join("".join(kept).replace(" ,", ",").replace(" ;", ";").split())


def summaries(help: str) -> set[str]:
    """What a summary of a flag's help may say: the help without its asides, whole or cut before a `,`, `:` or `;`."""
    short = without_asides(help)
    return {short} | {short[:m.start()] for m in re.finditer(r"[,:;] ", short)}


def meaning_problems(path: Path, summary: bool = False) -> list[str]:
    """Rows whose meaning is not the flag's help: the whole help, or with `summary`, one of its `summaries`."""
    parsers, problems = {}, []
    for line, script, flags, _ in flag_tables(path):
        if script not in parsers:
            parsers[script] = parse_only(REPO / script, [])[0]
        cell = meaning(path.read_text().splitlines()[line - 1].strip().strip("|").split("|", 2)[2].rsplit("|", 1)[0])
        for flag in flags:
            if flag not in parsers[script]._option_string_actions:
                continue
            said = meaning(help_text(parsers[script], flag))
            if cell not in (summaries(said) if summary else {said}):
                problems.append(f"line {line}: {script} {flag}: the table says {cell!r}, --help says {said!r}")
    return problems


def test_each_flag_rows_meaning_on_the_flags_page_is_what_its_help_says():
    """docs/flags.md's meaning column, for train_cifar.py, train_vit.py and train_minimal.py: each row's cell, without
    backticks and links to other pages, is the flag's --help text, so a meaning changed in the help and not on the
    page (or the reverse) fails here."""
    problems = meaning_problems(REPO / "docs" / "flags.md")
    assert not problems, "\n".join(problems)
    scripts = {script for _, script, _, _ in flag_tables(REPO / "docs" / "flags.md")}
    assert scripts == {"train_cifar.py", "train_vit.py", "train_minimal.py"}


def test_each_flag_rows_meaning_in_the_readme_is_its_help_without_asides_or_cut_at_a_clause():
    """The README's flags table (train_cifar.py) summarises: each meaning is the flag's --help text without its
    parenthesised asides, whole or cut before a comma, colon or semicolon, so the front page never says what the help
    does not."""
    problems = meaning_problems(REPO / "README.md", summary=True)
    assert not problems, "\n".join(problems)
    assert len(list(flag_tables(REPO / "README.md"))) >= 8


def test_a_readme_summary_may_cut_the_help_at_a_clause_but_not_reword_it():
    help = "fix the global batch: accumulation = this / (batch_size x processes), exactly; unset: from grad_accum"
    assert "fix the global batch" in summaries(help)
    assert "fix the global batch: accumulation = this /, exactly" in summaries(help)
    assert "fix the global batch; accumulation takes up the process count" not in summaries(help)
    assert without_asides("decay (e.g. 0.999; as min(D, (1+t)/(10+t)) at t), evaluated") == "decay, evaluated"


GUARANTEE = re.compile(r"^(?P<claim>.*): (?P<tests>`test_\w+`(?:, `test_\w+`)*)\.$", re.S)


def guarantees(text: str) -> list[tuple[str, str, list[str]]]:
    """(bullet, claim, named tests) for each bullet of the sections headed "Guarantees" or "More guarantees"."""
    found, inside, bullet = [], False, None
    for line in [*text.splitlines(), "## end"]:
        if line.startswith("## ") or line.startswith("- ") or not line.strip():
            if bullet is not None:
                match = GUARANTEE.match(" ".join(bullet.split()))
                found.append((bullet, match["claim"] if match else None,
                              re.findall(r"test_\w+", match["tests"]) if match else []))
                bullet = None
        if line.startswith("## "):
            inside = line[3:].strip().lower() in ("guarantees", "more guarantees")
        elif inside and line.startswith("- "):
            bullet = line[2:]
        elif inside and bullet is not None and line.startswith("  "):
            bullet += " " + line.strip()
    return found


def docstrings() -> dict[str, str]:
    """Every test function's docstring, by name."""
    return {node.name: ast.get_docstring(node) or "" for f in (REPO / "tests").glob("test_*.py")
            for node in ast.parse(f.read_text()).body if isinstance(node, ast.FunctionDef)}


def plain(text: str) -> str:
    return " ".join(text.replace("`", "").split()).lower()


TOLERANCE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?e-\d+|\d+(?:\.\d+)?\s?%|\d+(?:\.\d+)? points?)")  # 1e-5, 1%, 8 points


def code_of_tests() -> dict[str, tuple[str, bool]]:
    """Every test function's module code without its docstrings (where its tolerances and constants are), and
    whether the test can skip (pytest.skip in its body, or a skip or cuda mark), by name."""
    found = {}
    for f in (REPO / "tests").glob("test_*.py"):
        tree = ast.parse(f.read_text())
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        skips = {node.name: "skip" in ast.unparse(node) or any("skip" in ast.unparse(d) or "cuda" in ast.unparse(d)
                                                               for d in node.decorator_list) for node in functions}
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef) and ast.get_docstring(node):
                node.body = node.body[1:] or [ast.Pass()]
        code = ast.unparse(tree)
        found |= {name: (code, can_skip) for name, can_skip in skips.items()}
    return found


def written_forms(tolerance: str) -> set[str]:
    """How code may write a stated tolerance: 1e-5 as 1e-5 or 1e-05; 1% as 1% or 0.01; 8 points as 8."""
    number = re.match(r"[\d.]+(?:e-\d+)?", tolerance)[0]
    value = float(number) / (100 if tolerance.endswith("%") else 1)
    return {number, repr(value), f"{value:g}", tolerance.replace(" ", "")}


def guarantee_problems(text: str, docs: dict[str, str], code: dict[str, tuple[str, bool]] | None = None) -> list[str]:
    """What is wrong with a page's guarantees: a bullet that names no test, a test that does not exist, a test whose
    docstring does not state the claim; with `code` (code_of_tests()), a tolerance of the claim that the test's module
    code does not hold, and a test that can skip under a claim that does not say so."""
    problems = []
    for bullet, claim, tests in guarantees(text):
        if claim is None:
            problems.append(f"a guarantee that does not end by naming its tests (CLAIM: `test_a`, `test_b`.): {bullet}")
        for test in tests:
            if test not in docs:
                problems.append(f"{test} does not exist")
            elif plain(claim) not in plain(docs[test]):
                problems.append(f"{test}'s docstring does not state the claim {claim!r}")
            elif code is not None:
                source, can_skip = code[test]
                problems += [f"{test}'s code does not hold the tolerance {tol!r} its claim states"
                             for tol in TOLERANCE.findall(claim) if not written_forms(tol) & set(
                                 re.findall(r"[\w.%-]+", source))]
                if can_skip and "skip" not in claim.lower():
                    problems.append(f"{test} can skip, but its claim does not say when")
    return problems


@pytest.mark.parametrize("doc", [REPO / "README.md", REPO / "docs" / "testing.md"], ids=rel)
def test_each_guarantee_is_stated_in_the_docstring_of_every_test_it_names(doc):
    """Each bullet under Guarantees (README.md) and More guarantees (docs/testing.md) ends by naming its tests, and
    each named test's docstring contains the bullet's claim word for word (backticks, case and line breaks aside):
    a claim or a tolerance changed on one side only fails here. Each tolerance the claim states (1e-5, 1%, 8 points)
    appears in the named test's module code, and a test that can skip has a claim that says so."""
    found = guarantees(doc.read_text())
    assert len(found) >= 10, f"{rel(doc)}: {len(found)} guarantees found: the format changed?"
    problems = guarantee_problems(doc.read_text(), docstrings(), code_of_tests())
    assert not problems, "\n".join(problems)


def test_the_guarantee_check_catches_a_changed_tolerance_and_a_bullet_without_a_test():
    docs = {"test_x": "Two runs end within 1e-5 of each other. More details."}
    ok = "## Guarantees\n\n- Two runs end within\n  1e-5 of each other: `test_x`.\n"
    assert guarantee_problems(ok, docs) == []
    assert guarantee_problems(ok.replace("1e-5", "1e-6"), docs) == [
        "test_x's docstring does not state the claim 'Two runs end within 1e-6 of each other'"]
    assert len(guarantee_problems("## Guarantees\n\n- Two runs agree.\n", docs)) == 1
    assert guarantee_problems(ok.replace("test_x", "test_y"), docs) == ["test_y does not exist"]
    # the code: a docstring that states 1e-5 over an assertion of 1e-3, or a test that can skip, unsaid
    assert guarantee_problems(ok, docs, {"test_x": ("assert d <= 1e-05", False)}) == []
    assert guarantee_problems(ok, docs, {"test_x": ("assert d <= 1e-3", False)}) == [
        "test_x's code does not hold the tolerance '1e-5' its claim states"]
    assert guarantee_problems(ok, docs, {"test_x": ("TOL = 1e-5\npytest.skip('other data')", True)}) == [
        "test_x can skip, but its claim does not say when"]
    assert written_forms("1%") >= {"0.01"} and written_forms("8 points") >= {"8"}


DURATION = r"\d[\d,.]*\s?(?:ms|s|secs?|seconds?|min|mins|minutes?|h|hours?)\b"  # a time, in any unit
MEASURED = re.compile(r"(?<![\w./-])\d[\d,.]*\s?(?:img/s|images/s)(?![\w/])|\b\d[\d.]*x (?:faster|slower)\b"
                      r"|\b(?:takes?|took|taking|lasts?|lasted|spends?|spent|needs?|needed|measured at|(?:runs?|ran|"
                      r"finishe[sd]|ends?|ended|trains?|trained) in)\s+(?:about |around |roughly |some |under |over |"
                      r"nearly |almost )?" + DURATION)


def measured_outside_performance(text: str) -> list[str]:
    """Measured figures (a rate in images/s, "N x faster/slower", a duration in any tense and unit: "took N s", "takes
    about N min", "runs in N h") in prose and not in code, in a sentence that does not link to performance.md, where
    every measured figure lives with its command, machine and date. A limit or a timeout ("within 30 s", "600 s by
    default") is not a measurement."""
    text = re.sub(r"`[^`]*`", "", prose(text))
    found = []
    for sentence in re.split(r"(?<=[.;])\s+", text):
        if "performance.md" not in sentence:
            found += [m[0] for m in MEASURED.finditer(sentence)]
    return found


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "performance.md"], ids=rel)
def test_measured_figures_live_in_performance_md_or_link_to_it(doc):
    """A speed or time measured on some machine appears in docs/performance.md (with its command, machine and date);
    elsewhere only in a sentence that links there."""
    found = measured_outside_performance(doc.read_text())
    assert not found, f"{rel(doc)}: measured figures without a link to performance.md: {found}"


def test_the_measured_figure_check_catches_a_rate_a_speedup_and_a_duration_without_a_link():
    assert measured_outside_performance("It trains 590 img/s on a Xeon. It is 1.2x faster there.") == [
        "590 img/s", "1.2x faster"]
    assert measured_outside_performance("It trains 590 img/s ([performance.md](performance.md)).") == []
    assert measured_outside_performance("ResNet-18 img/s and MFU; `took 3 s` in code.") == []
    assert measured_outside_performance("A full run takes 7 min on a laptop. The first decode took about 2 h. It "
                                        "trains in 40 seconds; the suite ran in under 15 minutes.") == [
        "takes 7 min", "took about 2 h", "trains in 40 seconds", "ran in under 15 minutes"]
    assert measured_outside_performance("It stops within 30 s (600 s by default), retried after 4 s.") == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [rel(d) for d in DOCS[1:] if f"({rel(d)})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_readme_is_a_front_page_of_at_most_200_lines_and_2000_words():
    text = (REPO / "README.md").read_text()
    lines, words = len(text.splitlines()), len(prose(text).split())
    assert lines <= 200 and words <= 2000, f"README.md: {lines} lines, {words} words outside code"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_the_docs_say_what_is_not_what_was(doc):
    history = re.compile(r"\b(until 20\d\d|used to|as shipped (?:until|then)|no longer|previously|"
                         r"went from|before the change)\b", re.I)
    found = [m[0] for m in history.finditer(prose(doc.read_text()))]
    assert not found, f"{rel(doc)}: history in the docs: {found}"
    commits = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", prose(doc.read_text()))
    assert not commits, f"{rel(doc)}: commit hashes in the docs (git has the history): {commits}"


# ----------------------------------------------------------------------------------------------------
# The checkers themselves: each must catch what it is for
# ----------------------------------------------------------------------------------------------------
def test_the_checkers_catch_a_renamed_flag_a_wrong_default_a_bad_command_a_missing_test_and_a_broken_link(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("# Flags of train_cifar.py\n\n| flag | default | meaning |\n|---|---|---|\n"
                   "| `--learning-rate` | 0.1 | renamed |\n| `--epochs` | 31 | wrong default |\n"
                   "| `--lr` | 0.1 | right |\n")
    problems = []
    for _, script, flags, cell in flag_tables(doc):
        parser, defaults = parse_only(REPO / script, [])
        for flag in flags:
            action = parser._option_string_actions.get(flag)
            problems.append(flag if action is None or not same_default(getattr(defaults, action.dest),
                                                                         expected_default(cell)) else None)
    assert problems == ["--learning-rate", "--epochs", None]

    assert check_command(["python", "train_cifar.py", "--epochs", "2"]) is None
    assert "--mixed_precision" in check_command(["accelerate", "launch", "--config_file",
                                                 "accelerate_configs/cpu.yaml", "train_cifar.py",
                                                 "--mixed_precision", "bf16"])
    assert check_command(["accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml",
                          "--mixed_precision", "bf16", "train_cifar.py"]) is None
    assert "invalid int" in check_command(["accelerate", "launch", "--machine_rank", "R", "train_cifar.py"])
    assert "does not exist" in check_command(["accelerate", "launch", "--config_file", "accelerate_configs/9.yaml",
                                              "train_cifar.py"])
    assert "rejects" in check_command(["python", "compare_runs.py"])  # its runs argument is required
    assert "rejects" in check_command(["sbatch", "slurm/train_1node.sbatch", "--epoch-count", "3"])
    assert check_command(["SCRIPT=train_vit.py", "sbatch", "slurm/train_1node.sbatch", "--activation-checkpointing"]) \
        is None
    assert "rejects" in check_command(["sbatch", "slurm/train_1node.sbatch", "--activation-checkpointing"])

    assert "test_two_ranks_match_one_rank_weights" in defined_tests()
    assert "test_a_test_nobody_wrote" not in defined_tests()

    (tmp_path / "other.md").write_text("# Some Heading: with `code`\n")
    assert anchors(tmp_path / "other.md") == {"some-heading-with-code"}
    assert slug("FSDP2: what it does and when it pays") == "fsdp2-what-it-does-and-when-it-pays"

"""The commands a newcomer copies from the docs run: every flag, key and file they name exists.

Sources: README.md, launch/README.md, the opening comments of ``recipes/configs/*.yaml`` and of
``launch/*.yaml``, and the usage lines of the scripts' module docstrings. Each command line (fenced or indented code, or an inline ``python ...`` /
``accelerate launch ...`` span) is parsed the way its tool parses it: recipe scripts through
``core.config.parse_config`` with their config dataclass (``--config`` file loaded, every ``key=value``
checked and coerced), other CLIs through their own argparse parser (captured from their ``main``, so the
check reads the flags the code defines, not a copy), and ``accelerate launch`` through accelerate's own
launcher parser. Inline ``--flag`` and ``key=value`` spans in the prose are checked against the tool the
surrounding text names. Nothing runs a model: the whole module takes seconds.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import math
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "launch" / "README.md", ROOT / "bench" / "on_policy.md"]
HEADERS = sorted((ROOT / "recipes" / "configs").glob("*.yaml")) + sorted((ROOT / "launch").glob("*.yaml"))

# Words the docs use for "put your value here", replaced by an example before parsing.
PLACEHOLDERS = {"λ": "0.2", "S": "0", "N": "2", "M": "80", "W": "0.25", "H": "3", "τ": "0.8", "K": "25",
                "KEY": "secret", "DIR": "runs/x", "SECONDS": "60",
                "recipes/configs/<name>.yaml": "recipes/configs/tiny.yaml",
                "recipes/configs/NAME.yaml": "recipes/configs/tiny.yaml"}
# Commands that are not meant to be run as written.
NOT_COMMANDS = ("...", "YOUR_SCRIPT")
RECIPES = {"recipes/distill.py": ("recipes.distill", "DistillConfig"),
           "recipes/retrofit.py": ("recipes.retrofit", "RetrofitConfig"),
           "recipes/export.py": ("recipes.export", "ExportConfig"),
           "recipes/cache_teacher.py": ("recipes.cache_teacher", "CacheTeacherConfig")}
# Modules run with ``python -m`` whose ``main(argv)`` parses with argparse.
MODULES = ("distill.prune", "distill.plan", "eval.gate", "eval.longctx", "attention.show", "serve.generate",
           "serve.server")
COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?|accelerate)\s")


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # "README.md:123"
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


# ---- extraction -------------------------------------------------------------------------------------


def _join_continuations(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Lines ending in a backslash joined with the next, numbered by their first line."""
    start, parts = None, []
    for n, line in lines:
        start = n if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(p.strip() for p in parts)
        start, parts = None, []
    if parts:
        yield start, " ".join(p.strip() for p in parts)


def _commands_in_line(text: str) -> list[str]:
    """Shell lines chained with ``&&`` split into commands; a trailing ``# comment`` dropped."""
    text = re.sub(r"\s+#\s.*$", "", text)
    return [c.strip() for c in text.split("&&") if COMMAND_START.match(c.strip() + " ")]


def markdown_code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of fenced code blocks and of 4-space indented blocks (outside lists), numbered from 1."""
    out, fenced, prev_blank = [], False, True
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and (prev_blank or (out and out[-1][0] == n - 1))):
            if fenced or line.strip():
                out.append((n, line))
        prev_blank = not line.strip()
    return out


def _bench_span(span: str) -> str | None:
    """``bench/X.py --flag ...`` (or ``X.py --flag ...`` for a file in bench/) as a python command."""
    m = re.fullmatch(r"(?:bench/)?(\w+\.py)(\s.*)?", span, re.S)
    if m and (ROOT / "bench" / m[1]).is_file() and (m[2] or "").strip():
        return f"python bench/{m[1]}{m[2]}"
    return None


def inline_commands(text: str, where: Callable[[int], str]) -> list[Command]:
    """Inline code spans (they may wrap a line) that are commands: ``python ...``, ``accelerate launch ...``,
    or a bench script with its flags."""
    found = []
    for m in re.finditer(r"`([^`]+)`", text):
        span = " ".join(m[1].split())
        if COMMAND_START.match(span + " ") and not _is_mention(span):
            found.append(Command(where(m.start()), span))
        elif (cmd := _bench_span(span)) is not None:
            found.append(Command(where(m.start()), cmd))
    return found


def _is_mention(span: str) -> bool:
    """A tool named in prose without arguments (``python -m eval.gate``), or python's own tools (venv)."""
    words = span.split()
    return len(words) <= 3 and words[-1] in ("launch", *MODULES, "distill.data") or \
        words[:3] in (["python3", "-m", "venv"], ["python", "-m", "venv"]) or \
        (len(words) == 2 and words[1] in RECIPES)


def markdown_commands(path: Path) -> list[Command]:
    found = []
    for n, line in _join_continuations(markdown_code_lines(path)):
        found += [Command(f"{path.relative_to(ROOT)}:{n}", c) for c in _commands_in_line(line)
                  if not _is_mention(c)]
    text = re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), path.read_text(), flags=re.S)
    name = path.relative_to(ROOT)
    return found + inline_commands(text, lambda at: f"{name}:{text.count(chr(10), 0, at) + 1}")


def header_lines(path: Path) -> list[tuple[int, str]]:
    """The comment block a YAML file opens with, ``#`` stripped."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("#"):
            break
        out.append((n, line[1:]))
    return out


def header_commands(path: Path) -> list[Command]:
    """Commands that open a line of the opening comments (or follow a ``label:``), and inline spans."""
    lines, name = header_lines(path), path.relative_to(ROOT)
    found, block = [], []
    for n, t in lines:
        m = re.match(r"(?:\s*|[^`]*:\s{2,})(\S.*)$", t)
        if m and COMMAND_START.match(m[1] + " ") or (m and block and block[-1][1].rstrip().endswith("\\")):
            block.append((n, m[1]))
    for n, line in _join_continuations(block):
        found += [Command(f"{name}:{n}", c) for c in _commands_in_line(line) if not _is_mention(c)]
    text = "\n".join(t for _, t in lines)
    return found + inline_commands(text, lambda at: f"{name}:{text.count(chr(10), 0, at) + 1}")


def docstring_commands(path: Path) -> list[Command]:
    """The usage lines a script's module docstring opens with (``python bench/X.py [--flag N]``)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    block = []
    for n, line in enumerate(doc.splitlines(), 1):  # the docstring opens on the file's first line
        if COMMAND_START.match(line.strip() + " ") or (block and block[-1][1].endswith("\\")):
            block.append((n, line.strip()))
    name = path.relative_to(ROOT)
    return [Command(f"{name}:{n}", c) for n, line in _join_continuations(block) for c in _commands_in_line(line)
            if not _is_mention(c)]


# Scripts whose module docstring shows how to run them: every bench script and CLI module.
SCRIPTS = [*sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "recipes").glob("*.py")),
           *(ROOT / (m.replace(".", "/") + ".py") for m in MODULES), ROOT / "distill" / "data" / "__main__.py"]


def all_commands() -> list[Command]:
    found = [c for doc in DOCS for c in markdown_commands(doc)]
    found += [c for path in HEADERS for c in header_commands(path)]
    found += [c for path in SCRIPTS for c in docstring_commands(path)]
    return [c for c in found if not any(s in c.text for s in NOT_COMMANDS)]


# ---- the tools' own parsers ----------------------------------------------------------------------------


class _Captured(BaseException):  # BaseException: a main's `except Exception` must not swallow it
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def _capture_parser(run: Callable[[], object]) -> argparse.ArgumentParser:
    """The argparse parser ``run`` builds: its first ``parse_args`` call is stopped and its parser kept."""
    def stop(self, *args, **kwargs):
        raise _Captured(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", stop)
    mp.setattr(sys, "argv", ["x"])
    try:
        run()
    except _Captured as got:
        return got.parser
    finally:
        mp.undo()
    raise AssertionError("the tool never called parse_args")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def cli_parser(tool: str) -> argparse.ArgumentParser:
    """The parser of ``bench/NAME.py`` or of a module run with ``python -m``."""
    if tool not in _PARSERS:
        if tool.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"_docs_{Path(tool).stem}", ROOT / tool)
            module = importlib.util.module_from_spec(spec)
            path = list(sys.path)
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path[:] = path  # a bench script puts the repository first on the path for itself
        else:
            module = importlib.import_module(tool)
        _PARSERS[tool] = _capture_parser(module.main)
    return _PARSERS[tool]


def recipe_config(script: str) -> type:
    module, name = RECIPES[script]
    return getattr(importlib.import_module(module), name)


def argparse_problem(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """What ``parser`` says about ``argv`` (None: accepted). Nothing runs: only the parse."""
    err, abbrev = io.StringIO(), parser.allow_abbrev
    parser.allow_abbrev = False  # a doc must spell a flag out: `--engine` for `--engines` is drift too
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            argparse.ArgumentParser.parse_args(parser, argv)
    except SystemExit as stop:
        if stop.code:
            return err.getvalue().strip().splitlines()[-1]
    finally:
        parser.allow_abbrev = abbrev
    return None


def config_problem(cls: type, argv: list[str]) -> str | None:
    """What ``parse_config`` says about ``--config FILE key=value ...`` (None: accepted)."""
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    given = {a.split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")}
    filler = [f"{k}=x" for k in required if k not in given]  # required keys the doc leaves to the reader
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parse_config(cls, [*argv, *filler])
    except ConfigError as err:
        return str(err)
    except SystemExit as stop:  # --help
        return f"exit {stop.code}" if stop.code else None
    return None


def launcher_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser
    return launch_command_parser()


# ---- checking one command -----------------------------------------------------------------------------


def _tokens(text: str) -> list[str]:
    text = re.sub(r"\[(--[^\]]+)\]", r"\1", text)  # "[--soak 600]": an optional part, checked too
    for word, example in PLACEHOLDERS.items():
        text = re.sub(rf"(?<![\w/.-]){re.escape(word)}(?![\w/.-])", example, text)
    words = shlex.split(text)
    cut = [i for i, w in enumerate(words) if w in (">", ">>", "&", "|", "2>&1", ";")]  # shell, not the tool's
    words = words[:cut[0]] if cut else words
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment assignments
        words.pop(0)
    return words


def command_problems(cmd: Command) -> list[str]:
    words = _tokens(cmd.text)
    if words[0] == "accelerate":
        if words[1:2] != ["launch"]:
            return [f"{cmd}: only `accelerate launch` is expected"]
        if not any(w.endswith(".py") for w in words):  # launcher flags named in prose, no script
            return _flag_problems(cmd, ["accelerate launch"], words[2:])
        problem = argparse_problem(launcher_parser(), words[2:])
        if problem:
            return [f"{cmd}: accelerate launch: {problem}"]
        args = argparse.ArgumentParser.parse_args(launcher_parser(), words[2:])
        if args.config_file and not (ROOT / args.config_file).is_file():
            return [f"{cmd}: no launch config {args.config_file}"]
        return _script_problems(cmd, [args.training_script, *args.training_script_args])
    if words[0] in ("python", "python3"):
        if words[1] == "-m":
            return _module_problems(cmd, words[2], words[3:])
        return _script_problems(cmd, words[1:])
    return [f"{cmd}: not a python or accelerate command"]


def _script_problems(cmd: Command, words: list[str]) -> list[str]:
    script, argv = words[0], words[1:]
    if not (ROOT / script).is_file():
        return [f"{cmd}: no such script {script}"]
    if script in RECIPES:
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        if config and not (ROOT / config).is_file():
            return [f"{cmd}: no config file {config}"]
        problem = config_problem(recipe_config(script), argv)
        return [f"{cmd}: {problem}"] if problem else []
    if script.startswith("bench/"):
        problem = argparse_problem(cli_parser(script), argv)
        return [f"{cmd}: {problem}"] if problem else []
    return [f"{cmd}: no known parser for {script}"]


def _module_problems(cmd: Command, module: str, argv: list[str]) -> list[str]:
    if module == "distill.data":
        if argv[:1] != ["prepare"]:
            return [f"{cmd}: distill.data takes `prepare`"]
        from distill.data.__main__ import _parse  # its own num_proc=N, then the recipe's keys
        try:
            _parse(argv[1:])
        except ConfigError as err:
            return [f"{cmd}: {err}"]
        return []
    if module not in MODULES:
        return [f"{cmd}: module {module} is not a known CLI (add it to MODULES if it is one)"]
    problem = argparse_problem(cli_parser(module), argv)
    return [f"{cmd}: {problem}"] if problem else []


# ---- inline flags and keys, checked against the tools their section names --------------------------------

# Inline ``key=value`` / ``key: value`` spans that are not recipe keys, and what they are instead.
NOT_RECIPE_KEYS = {
    "device_map": "a transformers from_pretrained argument",
    "step_scheduler_with_optimizer": "an accelerate Accelerator argument",
    "tool_choice": "an OpenAI request field",
    "threads: N intra-op (why)": "what a recipe prints",
}


def sections(path: Path) -> list[tuple[int, str]]:
    """``(first line, text)`` of each ``##`` section (fenced code included: it names tools too)."""
    out, start, lines = [], 1, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("## ") and lines:
            out.append((start, "\n".join(lines)))
            start, lines = n, []
        lines.append(line)
    return [*out, (start, "\n".join(lines))]


def tools_named(text: str) -> list[str]:
    """Every CLI the text names: ``recipes/X.py`` (or ``X.py`` of a recipe), ``bench/X.py``, ``python -m X``
    and bare module names of our CLIs, ``accelerate launch``."""
    found = []
    for m in re.finditer(r"(?<![\w/])(?:recipes/)?(distill|retrofit|export|cache_teacher)\.py", text):
        found.append(f"recipes/{m[1]}.py")
    for m in re.finditer(r"(?<![\w/])(?:bench/)?(\w+)\.py", text):
        bench = ROOT / "bench" / f"{m[1]}.py"
        if bench.is_file() and "argparse" in bench.read_text() and f"recipes/{m[1]}.py" not in RECIPES:
            found.append(f"bench/{m[1]}.py")
    found += [m for m in MODULES if re.search(rf"(?<![\w.]){re.escape(m)}(?![\w])", text)]
    if "accelerate launch" in text:
        found.append("accelerate launch")
    return list(dict.fromkeys(found))


def _parser_of(tool: str) -> argparse.ArgumentParser:
    return launcher_parser() if tool == "accelerate launch" else cli_parser(tool)


def _flag_problems(where: object, tools: list[str], words: list[str]) -> list[str]:
    """``--flag [value]`` words accepted by one of ``tools``' parsers (a flag alone: the name only)."""
    flags = [w for w in words if w.startswith("--")]
    parsers = [_parser_of(t) for t in tools if not t.startswith("recipes/")]
    known = lambda p, f: f.split("=")[0] in p._option_string_actions  # noqa: E731
    bad = [f for f in flags if not any(known(p, f) for p in parsers)]
    if bad:
        return [f"{where}: {', '.join(bad)} is a flag of none of {tools}"]
    if len(words) == 1:
        return []
    owners = [p for p in parsers if all(known(p, f) for f in flags)]
    if not owners:
        return [f"{where}: no single tool of {tools} takes all of {flags}"]
    # The value too: a parse with the other required options filled in the owner's own way.
    problems = []
    for p in owners:
        filler = [x for a in p._actions if a.required and a.option_strings
                  and a.option_strings[0] not in words for x in (a.option_strings[0], "x")]
        script = ["x.py"] if any(a.dest == "training_script" for a in p._actions) else []
        problems.append(argparse_problem(p, [*filler, *words, *script]))
    return [] if None in problems else [f"{where}: {problems[0]}"]


def _key_problems(where: object, tools: list[str], pairs: dict[str, str]) -> list[str]:
    """Recipe keys with their values, accepted by one of the recipes ``tools`` names."""
    classes = [recipe_config(t) for t in tools if t in RECIPES]
    if not classes:
        return [f"{where}: {sorted(pairs)} without a recipe named in its section"]
    problems = []
    for key, value in pairs.items():
        owners = [c for c in classes if key in {f.name for f in dataclasses.fields(c)}]
        if not owners:
            problems.append(f"{where}: {key} is a key of none of {[c.__name__ for c in classes]}")
            continue
        for v in value.split("|") if value else []:  # "prefix|chat": each alternative
            if not any(config_problem(c, [f"{key}={v}"]) is None for c in owners):
                problems.append(f"{where}: {config_problem(owners[0], [f'{key}={v}'])}")
    return problems


def inline_spans(path: Path) -> Iterator[tuple[str, str, list[str]]]:
    """``(where, span, tools its section names)`` for inline code spans outside fenced blocks (a section
    that names no recipe: the recipes of the whole document too)."""
    recipes = [t for t in tools_named(path.read_text()) if t in RECIPES]
    for start, text in sections(path):
        tools = tools_named(text)
        tools += [] if any(t in RECIPES for t in tools) else recipes
        prose = re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S)
        for m in re.finditer(r"`([^`]+)`", prose):
            yield f"{path.relative_to(ROOT)}:{start + prose.count(chr(10), 0, m.start())}", \
                " ".join(m[1].split()), tools


def inline_problems(where: str, span: str, tools: list[str]) -> list[str]:
    if span in NOT_RECIPE_KEYS or re.split(r"[=:]", span)[0] in NOT_RECIPE_KEYS:
        return []
    if re.match(r"--\w", span):
        return _flag_problems(f"{where}: `{span}`", tools, _tokens(span.replace("[", "").replace("]", "")))
    if re.fullmatch(r"(?:[a-z_]+=\S*\s*)+", span) and span != "key=value":
        pairs = dict(_tokens(w)[0].split("=", 1) if _tokens(w) else (w.rstrip("="), "")
                     for w in span.split())
        return _key_problems(f"{where}: `{span}`", tools, pairs)
    if re.fullmatch(r"[a-z_]+: .+", span):
        if where.startswith("launch/"):  # accelerate's own config keys, as the launch configs use them
            keys = {k for f in (ROOT / "launch").glob("*.yaml") for k in yaml.safe_load(f.read_text())}
            key = span.split(":")[0]
            return [] if key in keys else [f"{where}: `{span}`: {key} is in no launch/*.yaml"]
        return _key_problems(f"{where}: `{span}`", tools, {k: yaml.safe_dump(v, default_flow_style=True).strip()
                                                          .removesuffix("...").strip()
                                                          for k, v in yaml.safe_load(span).items()})
    return []


def all_inline() -> list[tuple[str, str, list[str]]]:
    return [s for doc in DOCS for s in inline_spans(doc)
            if re.match(r"--\w|[a-z_]+=(?!=)|[a-z_]+: ", s[1]) and s[1] not in ("--no-deps",)]


# ---- install commands, files and names -----------------------------------------------------------------


def readme_block_with(word: str) -> str:
    """The one fenced set-up block (``python3 -m venv ...``) of README.md that contains ``word``."""
    blocks = [b for b in re.findall(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
              if b.startswith("python3 -m venv") and word in b]
    assert len(blocks) == 1, f"expected one set-up block with {word!r} in README.md, found {len(blocks)}"
    return blocks[0].strip()


def install_parts(command: str) -> dict[str, object]:
    """What a ``venv && pip install ... && run`` line installs: torch pin, extras, --no-deps wheels, the run."""
    steps = [shlex.split(c) for c in command.split("&&")]
    pins = [w for st in steps if st[:2] == ["pip", "install"] for w in st if w.startswith("torch")]
    extras = [w for st in steps if st[:2] == ["pip", "install"] for w in st if w.startswith(".[")]
    nodeps = [w for st in steps if "--no-deps" in st for w in st[st.index("--no-deps") + 1:]]
    return {"venv": steps[0], "torch": pins, "extras": set(re.findall(r"\w+", extras[0][1:])) if extras else set(),
            "nodeps": set(nodeps), "run": steps[-1]}


def pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def backticked(path: Path) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", path.read_text()))


# Backticked names with a slash that are outputs a run writes, not files of the repository.
RUN_OUTPUTS = ("runs/", "exports/", "final/", "pruned/", "output_dir/", "checkpoints/", "gate-report/", "students/",
               "teacher/", "previous-release/")


# ---- tests --------------------------------------------------------------------------------------------


def test_the_docs_hold_the_commands_this_test_expects():
    """The extraction finds the commands it should: a broken extractor must not pass by finding none."""
    texts = [c.text for c in all_commands()]
    assert any("distill.prune --model" in t for t in texts)
    assert any(t.startswith("ACCELERATE_USE_CPU=true accelerate launch --config_file launch/cpu_ddp_2proc.yaml")
               for t in texts)
    assert any("eval.gate --candidate" in t for t in texts)
    heads = {c.where.split(":")[0] for c in all_commands() if not c.where.startswith(("README", "launch/README"))}
    assert {str(p.relative_to(ROOT)) for p in HEADERS} - heads == {"launch/gpu_fsdp.yaml"}  # runs YOUR_SCRIPT.py
    spans = all_inline()
    assert any(s == "--on-clip 2 --project data" for _, s, _ in spans)
    assert any(s.startswith("student_init=keep_layers keep_layers=") for _, s, _ in spans)


@pytest.mark.parametrize("cmd", all_commands(), ids=str)
def test_every_documented_command_parses(cmd):
    assert not command_problems(cmd)


def test_the_checks_catch_a_wrong_flag_key_value_and_file():
    """Each kind of drift the tests above look for is reported (so their silence means something)."""
    assert command_problems(Command("x", "python -m distill.prune --model m --out o --target-raito 0.3"))
    assert command_problems(Command("x", "python bench/decode.py --cases 8k --engine mixed"))
    assert command_problems(Command("x", "accelerate launch recipes/distill.py max_step=3"))
    assert command_problems(Command("x", "accelerate launch recipes/distill.py kd_kind=forward"))
    assert command_problems(Command("x", "accelerate launch --config_file launch/nope.yaml recipes/distill.py"))
    assert command_problems(Command("x", "accelerate launch --num_process 2 recipes/distill.py"))
    assert command_problems(Command("x", "python recipes/export.py --config recipes/configs/nope.yaml"))
    tools = tools_named("`bench/on_policy.py` and `python -m serve.server`")
    assert tools == ["bench/on_policy.py", "serve.server"]
    assert inline_problems("x", "--on-clipp 2", tools)
    assert inline_problems("x", "--on-clip two", tools)
    assert not inline_problems("x", "--on-clip 2 --project data", tools)
    assert inline_problems("x", "--project data --max-batch 2", tools)  # one tool must take them all
    assert inline_problems("x", "gen_prompts=prefix|chatt", ["recipes/distill.py"])
    assert not inline_problems("x", "gen_prompts=prefix|chat", ["recipes/distill.py"])


def test_ci_runs_the_readme_test_command_verbatim():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci == [readme_block_with("pytest")]


def test_the_two_readme_commands_agree_with_each_other_and_pyproject():
    demo, tests = install_parts(readme_block_with("recipes/distill.py")), install_parts(readme_block_with("pytest"))
    assert demo["venv"] == tests["venv"] and demo["torch"] == tests["torch"] and len(demo["torch"]) == 1
    assert demo["extras"] <= tests["extras"], "the tests must install what the demo needs"
    assert demo["nodeps"] <= tests["nodeps"]
    assert demo["run"] == ["accelerate", "launch", "recipes/distill.py"] and tests["run"] == ["pytest"]
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    assert tests["extras"] <= set(extras)
    # The README's "the project itself only asks for `torch>=X`" is the dependency pyproject declares.
    floor = re.search(r"only asks for `(torch>=[\d.]+)`", (ROOT / "README.md").read_text())
    assert floor and floor[1] in project["dependencies"]


def test_every_extra_and_pinned_package_the_docs_install_is_in_pyproject():
    extras = pyproject()["project"]["optional-dependencies"]
    declared = {spec.replace(" ", "") for specs in extras.values() for spec in specs}
    for doc in DOCS:
        text = doc.read_text()
        for group in re.findall(r"pip install -e \"\.\[([\w,]+)\]\"", text):
            assert set(group.split(",")) <= set(extras), f"{doc.name}: extra(s) {group} not in pyproject.toml"
        for spec in re.findall(r"pip install \"([\w-]+[<>=~!][^\"]+)\"", text):
            assert spec.replace(" ", "") in declared, f"{doc.name}: {spec} is not what pyproject.toml declares"


def test_files_modules_and_variables_the_docs_name_exist():
    code = "\n".join(p.read_text() for pkg in ("core", "distill", "attention", "serve", "eval", "recipes")
                     for p in (ROOT / pkg).rglob("*.py"))
    missing = []
    for doc in [*DOCS, *HEADERS]:
        for name in backticked(doc):
            if re.fullmatch(r"[\w.-]+(?:/[\w.-]+)+/?|[\w-]+/", name) and not name.startswith(RUN_OUTPUTS):
                if not (ROOT / name).exists():
                    missing.append(f"{doc.name}: file {name}")
            elif (m := re.fullmatch(r"((?:core|distill|attention|serve|eval)(?:\.\w+)+)(?:\(.*\))?", name)) \
                    and not name.endswith(".py"):
                if not _resolves(m[1]):
                    missing.append(f"{doc.name}: {name} does not import")
        for var in set(re.findall(r"\b(HYBRID_DISTILL_\w+)", doc.read_text())):
            if var not in code:
                missing.append(f"{doc.name}: no code reads {var}")
    assert not missing, "\n".join(sorted(missing))


def _resolves(dotted: str) -> bool:
    """``pkg.module.attr...`` names a module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("span", all_inline(), ids=lambda s: f"{s[0]} {s[1]}")
def test_every_inline_flag_and_key_belongs_to_the_tool_its_section_names(span):
    assert not inline_problems(*span)


def test_the_load_test_traffic_the_readme_describes_is_the_locustfile():
    """Shares, ``max_tokens`` per class and pauses, read from bench/locustfile.py's source (locust not needed)."""
    tree = ast.parse((ROOT / "bench" / "locustfile.py").read_text())
    classes = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CLASSES")
    weights = {f.name: d.args[0].value for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               for d in f.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "task"}
    pause = next(tuple(a.value for a in n.value.args) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "wait_time")
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"`bench/locustfile\.py`: (\d+) % short, (\d+) % medium, (\d+) % long prompts with `max_tokens` "
                  r"(\d+) / (\d+) / (\d+), streaming, users pausing ([\d.]+)–([\d.]+) s", text)
    assert m, "README.md no longer describes the load test's traffic in the words this test reads"
    order = ("short", "medium", "long")
    total = sum(weights[c] for c in order)
    assert [int(m[i]) for i in (1, 2, 3)] == [round(100 * weights[c] / total) for c in order]
    assert [int(m[i]) for i in (4, 5, 6)] == [classes[c][1] for c in order]
    assert (float(m[7]), float(m[8])) == pause


def test_a_bench_command_quoted_for_the_demo_student_loads_the_student():
    """A bench whose ``--model`` defaults to the demo teacher measures the teacher unless told otherwise: a
    command the README quotes in a sentence about the student must name the student's folder."""
    text = (ROOT / "README.md").read_text()
    wrong = []
    for m in re.finditer(r"`((?:python )?bench/\w+\.py[^`]*)`", text):
        words = _tokens(m[1].removeprefix("python "))
        if "argparse" not in (ROOT / words[0]).read_text():  # bench/locustfile.py: locust's, not a CLI
            continue
        model = next((a for a in cli_parser(words[0])._actions if "--model" in a.option_strings), None)
        before = text[max(0, m.start() - 80):m.start()].replace("\n", " ").split(". ")[-1]
        if model is not None and model.default and "student" in before.lower() and "--model" not in words:
            wrong.append(f"`{m[1]}` after '{before.strip()}' measures {model.default}")
    assert not wrong, "\n".join(wrong)


def test_the_memory_plans_the_docs_quote_run():
    """``python -m distill.plan`` reads no model: the documented plans run for real, in-process."""
    from distill import plan
    plans = [c for c in all_commands() if re.match(r"python -m distill\.plan .*--config recipes/configs/\w+\.yaml", c.text)]
    assert plans
    for cmd in plans:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert plan.main(_tokens(cmd.text)[3:]) == 0, cmd
        assert '"fits": true' in out.getvalue(), f"{cmd}: the plan the docs recommend does not fit"


def test_the_launch_table_matches_the_launch_configs():
    """launch/README.md's table: one row per launch config, its process count, precision and sharding."""
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| `(\w+\.yaml)` \| ([^|]+) \| ([^|]+) \|",
                                                     (ROOT / "launch" / "README.md").read_text(), re.M)}
    assert set(rows) == {p.name for p in (ROOT / "launch").glob("*.yaml")}
    for name, (processes, sharded) in rows.items():
        cfg = yaml.safe_load((ROOT / "launch" / name).read_text())
        counts = [int(n) for n in re.findall(r"\d+", processes.split(",")[0])]
        assert math.prod(counts) == cfg["num_processes"], name
        assert cfg.get("num_machines", 1) == (counts[0] if len(counts) == 2 else 1), name
        assert ("CPU" in processes) == bool(cfg.get("use_cpu")), name
        assert ("bf16" in processes) == (cfg["mixed_precision"] == "bf16"), name
        ds = cfg.get("deepspeed_config", {})
        stage = ds.get("zero_stage")
        assert ("as ZeRO-3" in sharded or "+ param" in sharded) == (stage == 3), name  # rows add to the row above
        assert sharded.startswith("optimizer states") == (stage == 2), name
        assert ("CPU RAM" in sharded) == (ds.get("offload_param_device") == "cpu"), name
        assert ("FSDP" in sharded) == (cfg["distributed_type"] == "FSDP"), name
        # The recipe's grad_accum is the one that counts (launch/README.md, "Settings split ..."): never here.
        assert "gradient_accumulation_steps" not in ds and "gradient_accumulation_steps" not in cfg, name


# Optional extras a config needs beyond the README's demo install, by what in the config asks for them.
def _extras_needed(path: Path) -> set[str]:
    cfg, header = yaml.safe_load(path.read_text()), "\n".join(t for _, t in header_lines(path))
    needs = {cfg["tracker"]} if cfg.get("tracker") in ("wandb", "tensorboard") else set()
    if re.search(r"--config_file launch/(deepspeed|multinode)", header):
        needs.add("deepspeed")
    if cfg.get("gate") or cfg.get("quantize", "none") != "none":
        needs.add("eval")
    return needs


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_a_config_header_says_which_extras_its_command_needs(path):
    needs = _extras_needed(path)
    named = {e for _, t in header_lines(path) for m in re.findall(r"pip install -e \"\.\[([\w,]+)\]\"", t)
             for e in m.split(",")}
    assert needs <= named, f"{path.name} needs pip install -e \".[{','.join(sorted(needs))}]\" in its header"


def test_calls_the_docs_spell_out_match_the_signatures():
    """``pkg.f(a=..)`` keywords, and the parameter lists the docs spell out (three names or more), exist."""
    wrong, seen = [], 0
    for doc in DOCS:
        for span in backticked(doc):
            m = re.fullmatch(r"((?:core|distill|attention|serve|eval)(?:\.\w+)+)\((.*)\)", span)
            if not m:
                continue
            obj = importlib.import_module(m[1].rsplit(".", 1)[0])
            params = inspect.signature(getattr(obj, m[1].rsplit(".", 1)[1])).parameters
            args = [a.strip() for a in m[2].split(",") if a.strip() not in ("", "...")]
            names = [a.split("=")[0] for a in args if "=" in a] + \
                    ([a for a in args if "=" not in a] if len([a for a in args if "=" not in a]) >= 3 else [])
            seen += bool(names)
            wrong += [f"{doc.name}: `{span}`: no parameter {n}" for n in names if n not in params]
    assert seen >= 2 and not wrong, "\n".join(wrong)


# "`--flag` ... (default N", "`key`, default N", "`key` (N", "`key`, N", "`key` N": a default quoted by its name.
QUOTED_DEFAULT = re.compile(r"`(--[\w-]+|[a-z_]+)`(?:[^`(]{0,40}?\(default:? |,? default | \(|,? )"
                            r"(\d[\d.]*)( MiB| s\b)?")


def quoted_defaults(path: Path) -> Iterator[tuple[str, str, float, list[str]]]:
    """``(where, name, value, tools of the section)`` for each default the prose quotes beside a name."""
    for start, text in sections(path):
        tools = tools_named(text)
        for m in QUOTED_DEFAULT.finditer(text):
            value = float(m[2].rstrip(".")) * (2**20 if m[3] == " MiB" else 1)
            yield f"{path.name}:{start + text.count(chr(10), 0, m.start())}", m[1], value, tools


def code_defaults(name: str, tools: list[str]) -> list[object]:
    """The defaults ``name`` (a ``--flag`` or a recipe key) has in each of ``tools`` that defines it."""
    found = []
    for tool in tools:
        if tool in RECIPES and not name.startswith("--"):
            found += [f.default for f in dataclasses.fields(recipe_config(tool)) if f.name == name]
        elif tool not in RECIPES and name.startswith("--"):
            parser = _parser_of(tool)
            if name in parser._option_string_actions:
                found.append(parser._option_string_actions[name].default)
    return found


def test_defaults_the_docs_quote_are_the_code_defaults():
    checked, wrong = 0, []
    for doc in DOCS:
        for where, name, value, tools in quoted_defaults(doc):
            defaults = [d for d in code_defaults(name, tools)
                        if isinstance(d, (int, float)) and not isinstance(d, bool)]
            if not defaults:  # a name the section's tools do not define (`generate`, locust's `max_tokens`)
                continue
            checked += 1
            if not any(math.isclose(float(d), value) for d in defaults):
                wrong.append(f"{where}: `{name}` quoted as {value:g}, the code's default is {defaults}")
    assert checked >= 8 and not wrong, "\n".join(wrong)


def _string_literals(*packages: str) -> set[str]:
    """Every string constant (f-string parts included) in the packages' source."""
    found = set()
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            found |= {n.value for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return found


def test_the_run_folder_the_readme_draws_is_what_the_recipe_writes():
    """Each entry of README.md's ``runs/mine/`` picture, and the summary.json keys it lists, is a name the
    training code writes (a static check; tests/test_recipe_distill.py runs the recipe)."""
    block = readme_block_with_tree("runs/mine/")
    entries = re.findall(r"^  (\S+)\s{2,}", block, re.M)
    assert {"config.yaml", "final/", "summary.json", "metrics.jsonl"} <= set(entries)
    literals = _string_literals("core", "distill", "recipes")
    parts = {p for e in entries for p in re.sub(r"-N/?$", "-", e).rstrip("/").split("/")}
    missing = sorted(p for p in parts if p not in literals)
    summary = " ".join(re.search(r"summary\.json\s+(.*?)\.\.\.", block, re.S)[1].split())
    names = []
    for key in summary.split(" (")[0].split(", "):  # "steps, ..., student_ppl_init/final, ..., environment"
        first, _, second = key.partition("/")
        names += [first] + ([f"{first.rsplit('_', 1)[0]}_{second}"] if second else [])
    assert "student_ppl_final" in names and "environment" in names
    missing += [f"summary key {k}" for k in names if k not in literals]
    from core.environment import environment
    stem = lambda word: word.split()[0].lower().removesuffix("s")  # noqa: E731  "package versions" -> "package"
    recorded = {stem(k) for k in environment()}
    words = re.search(r"environment \(([^)]*)\)", summary)[1].split(", ")  # "Python, package versions, ..."
    missing += [f"environment field {w}" for w in words if stem(w) not in recorded]
    assert not missing, missing


def readme_block_with_tree(root: str) -> str:
    blocks = [b for b in re.findall(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
              if b.startswith(root)]
    assert len(blocks) == 1, f"expected one {root} picture in README.md"
    return blocks[0]

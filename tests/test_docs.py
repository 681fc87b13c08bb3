"""The documentation's gates (a few seconds): docs/configuration.md is what the code generates,
no relative link in the README or under docs/ is dead (files and #anchors, GitHub's slugs), no
page under docs/ is unreachable, and every `omnifabric` command the code blocks show exists
with the flags shown (checked against each command's own `--help`)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")
SHELLS = {"", "bash", "sh", "shell", "console"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose_lines(text: str, blank_code: bool = True) -> list[str]:
    """The lines of `text` outside fenced code blocks (inline code spans blanked unless
    `blank_code` is false)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", " ", line) if blank_code else line)
    return lines


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of `text`."""
    blocks: list[tuple[str, str]] = []
    language, body, fenced = "", [], False
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and not fenced:
            fenced, language, body = True, line.strip()[3:].strip().lower(), []
        elif match:
            fenced = False
            blocks.append((language, "\n".join(body)))
        elif fenced:
            body.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, everything but
    letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The #anchors a page offers: its headings' slugs (repeats numbered as GitHub does) and
    explicit HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for line in prose_lines(text, blank_code=False):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


def relative_links(path: Path) -> list[str]:
    """The link targets of a page that are neither absolute URLs nor mail addresses."""
    text = path.read_text(encoding="utf-8")
    targets = []
    for line in prose_lines(text):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                targets.append(target)
    return targets


def test_the_configuration_page_is_what_the_code_generates():
    from omnifabric.tools import config_doc

    page = ROOT / "docs" / "configuration.md"
    text = page.read_text(encoding="utf-8")
    assert config_doc.render(text) == text, (
        "docs/configuration.md is stale: run `omnifabric config-doc` "
        "(python -m omnifabric.tools.config_doc)"
    )


def test_no_relative_link_is_dead():
    cache: dict[Path, set[str]] = {}
    dead = []
    for page in PAGES:
        for target in relative_links(page):
            name, _, anchor = target.partition("#")
            where = (page.parent / name).resolve() if name else page
            if not where.exists():
                dead.append(f"{rel(page)}: {target} (no such file)")
                continue
            if anchor and where.suffix == ".md":
                if where not in cache:
                    cache[where] = anchors(where)
                if anchor not in cache[where]:
                    dead.append(f"{rel(page)}: {target} (no such heading in {rel(where)})")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_every_docs_page_is_linked_from_another_page():
    linked = set()
    for page in PAGES:
        for target in relative_links(page):
            name = target.partition("#")[0]
            if name:
                linked.add((page.parent / name).resolve())
    orphans = [rel(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"pages no other page links to (add them to the README's map): {orphans}"


def shown_commands() -> list[tuple[str, list[str], str]]:
    """(command, flags, where) for every `omnifabric COMMAND ...` line of a shell code block
    in the README and the docs, backslash continuations joined, comments dropped."""
    shown = []
    for page in PAGES:
        for language, body in code_blocks(page.read_text(encoding="utf-8")):
            if language not in SHELLS:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip().removeprefix("$ ")
                words = line.split()
                while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                    words.pop(0)  # VAR=value before the command
                if len(words) >= 2 and words[0] == "omnifabric":
                    flags = [f.split("=")[0] for f in words[2:] if f.startswith("--")]
                    shown.append((words[1], flags, f"{rel(page)}: {line}"))
    return shown


def shown_modules() -> list[tuple[str, str]]:
    """(module, where) for every `python -m omnifabric.X` line of a shell code block."""
    found = []
    for page in PAGES:
        for language, body in code_blocks(page.read_text(encoding="utf-8")):
            if language in SHELLS:
                for module in re.findall(r"python3? -m (omnifabric[\w.]*)", body):
                    found.append((module, rel(page)))
    return found


HELP_SCRIPT = """
import contextlib, io, json, sys
from omnifabric.tools import cli
helps = {}
for command in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([command, "--help"])
        except SystemExit as exc:
            code = exc.code
    helps[command] = out.getvalue() if code in (0, None) else None
print(json.dumps(helps))
"""


def test_every_command_shown_exists_with_its_flags():
    shown = shown_commands()
    assert shown, "no `omnifabric` command found in the code blocks"
    commands = sorted({command for command, _, _ in shown})
    result = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, *commands],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    helps = json.loads(result.stdout.splitlines()[-1])
    wrong = []
    for command, flags, where in shown:
        text = helps.get(command)
        if text is None:
            wrong.append(f"{where}\n  no command `omnifabric {command}`")
            continue
        known = set(FLAG.findall(text))
        missing = [flag for flag in flags if flag not in known]
        if missing:
            wrong.append(f"{where}\n  `omnifabric {command}` has no {', '.join(missing)}")
    assert not wrong, "\n".join(wrong)


def test_every_module_shown_exists():
    missing = [
        f"{where}: python -m {module}"
        for module, where in shown_modules()
        if importlib.util.find_spec(module) is None
    ]
    assert not missing, missing


def test_the_slugs_are_githubs():
    assert slug("`session.closed` reasons") == "sessionclosed-reasons"
    assert slug("What `bash tools/dev` does") == "what-bash-toolsdev-does"
    assert slug("MiniCPM-o 4.5") == "minicpm-o-45"
    assert slug("2026-11-25: the worker design's floor") == "2026-11-25-the-worker-designs-floor"
    assert slug("Chat (`/v1/realtime?mode=chat`)") == "chat-v1realtimemodechat"

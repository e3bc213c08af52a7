"""The repository speaks of the product alone: no file in it tells how its development went.

Every text file git knows of (tracked, or new and not ignored) is read line by line for four
kinds of development talk: a numbered or ordinal working session, an issue or pull-request
number, a review of the work, and a path of a development machine. Each kind is a pattern
precise enough that the product's own words stay legal: a tmux session (`new-session`,
`kill-session`), `start_new_session`, a browser session, a pytest fixture's scope, "preview",
"review the diff", a GPU stream that issues work. Every offending line is printed as
file:line: text. This file is the one not read: its patterns and examples would be hits.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
             "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth "
             "twentieth thirtieth fortieth").split()
_TENS = "twenty thirty forty"
_UNITS = "first second third fourth fifth sixth seventh eighth ninth"
_ORDINAL = (rf"(?:(?:{'|'.join(_TENS.split())})-(?:{'|'.join(_UNITS.split())})"
            rf"|{'|'.join(_ORDINALS)}|\d+(?:st|nd|rd|th))")

# (kind, pattern), matched case-insensitively against each line
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(p, re.IGNORECASE)) for kind, p in (
        ("working session", rf"\b{_ORDINAL}\s+sessions?\b"),
        ("working session", r"\bsessions?\s+#?\d+\b"),
        ("working session", r"\b(?:working|development|dev|coding|GPU|device)\s+sessions?\b"),
        ("issue number", r"\b(?:issue|PR|pull\s+request)\s*#?\d+\b|\bissues\s*#\d+"),
        ("review of the work", r"\breviewers?\b|\breviewed\b"),
        ("review of the work", r"\b(?:code|independent|peer)\s+reviews?\b"),
        ("review of the work",
         r"\breview\s+(?:found|fix(?:es|ed)?|said|notes?|comments?|asked|flagged|round)\b"),
        ("development machine path", r"(?<![\w.~-])/(?:work|root)/"),
        ("development machine path", r"/tmp/cvenv\b|(?<![\w-])\.pyenv\b"),
    ))


def offences(line: str) -> list[str]:
    """The kinds of development talk in one line of text (empty: none)."""
    return [kind for kind, pattern in PATTERNS if pattern.search(line)]


def repository_files() -> list[Path]:
    """Every file git knows of in the checkout: tracked, or untracked and not ignored; a tracked
    file deleted in the work tree is left out."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"git ls-files in {ROOT}: {r.stderr.strip()}"
    names = dict.fromkeys(n for n in r.stdout.split("\0") if n)
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def text_lines(path: Path) -> list[str] | None:
    """The file's lines, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None


@pytest.mark.parametrize("line", [
    "Eighteenth session, one H200, one call",
    "the twenty-first session's figures",
    "measured in the 12th session",
    "as in session 12",
    "sessions 12 to 14",
    "the next GPU session",
    "ANDREA's CUDA step (issue 11).",
    "see issue #13",
    "fixed in PR 7",
    "the reviewer compared the PTX",
    "an independent review found it",
    "launch guards (review fixes)",
    "reviewed; default 1",
    "logs in /work/andrea-shots/gpu/s8/",
    "ANDREA_FLEX_PYTHON=/tmp/cvenv/bin/python",
    "/root/.pyenv/versions/3.12.1/bin/python3.12",
])
def test_development_talk_is_caught(line: str) -> None:
    assert offences(line), line


@pytest.mark.parametrize("line", [
    'tmux("new-session", "-d", "-s", name)',
    'tmux("kill-session", "-t", session)',
    "Each test runs its own tmux session",
    "subprocess.Popen(cmd, start_new_session=True)",
    "the browser session's websocket",
    '@pytest.fixture(scope="session")',
    "news of this session only",
    "the page shows a preview of the run",
    "review the diff of the golden files",
    "a lane issues 16 loads before it adds them",
    "def _run(self, key, issue):",
    "runs/ANDREA-tiny/work/log.txt",
    "the checkpoints of an earlier session",
])
def test_the_products_own_words_stay_legal(line: str) -> None:
    assert not offences(line), offences(line)


def test_no_file_tells_how_its_development_went() -> None:
    this = Path(__file__).resolve()
    hits = []
    for path in repository_files():
        if path.resolve() == this:
            continue
        lines = text_lines(path)
        for number, line in enumerate(lines or (), 1):
            if kinds := offences(line):
                rel = path.relative_to(ROOT)
                hits.append(f"{rel}:{number}: {', '.join(kinds)}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines tell how the development went:\n" + "\n".join(hits)

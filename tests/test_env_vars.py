"""Every ANDREA_* environment variable the code reads is in the README's table, and the table
lists no variable that nothing reads any more."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# os.environ.get("ANDREA_X" ...), os.environ["ANDREA_X"], os.getenv("ANDREA_X"), a module
# constant naming one (`TOKEN = "ANDREA_X"`, read through it), or the CUDA backend's readers of
# switches and counts (`.flag("ANDREA_X"`, `.count("ANDREA_X"`: engine/backends/cuda/settings.py)
READ = re.compile(
    r"""(?:environ\.get\(|environ\[|getenv\(|\.flag\(|\.count\(|^[A-Z_]+ = )\s*["'](ANDREA_\w+)["']""",
    re.M)
ROW = re.compile(r"^\| `(ANDREA_\w+)` \|", re.M)
# a variable named in a row of the table (the fusion switches share ANDREA_FUSIONS's row)
NAMED = re.compile(r"`(ANDREA_\w+)`")


def read_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in ("engine", "andrea_tui", "tests", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # the examples in READ's comment
            for name in READ.findall(path.read_text()):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_pattern_finds_a_known_read() -> None:
    assert "ANDREA_UPDATE_GOLDEN" in read_in_code()  # tests/test_tui_golden.py reads it


def test_every_env_var_is_documented_and_every_documented_one_is_read() -> None:
    code = read_in_code()
    readme = (ROOT / "README.md").read_text()
    documented = set(ROW.findall(readme))
    named = {n for row in readme.splitlines() if ROW.match(row) for n in NAMED.findall(row)}
    undocumented = {n: code[n] for n in sorted(set(code) - named)}
    assert undocumented == {}, "add these to the README's environment-variable table"
    assert sorted(documented - set(code)) == [], "the README documents variables nothing reads"

"""The command line page (docs/cli.md) shows what the commands print.

The page makes a small run with its ```python block and shows each command on it in ```console blocks
(``$ flax-ckpt ...`` then the output). Here the run is made the same way in a fresh folder, every
command of those blocks runs in order, and its output must be the one on the page, up to what changes
from run to run: the date and time a step was created, a step's size on disk (its manifest holds a
timestamp), the folder (shown as /home/you) and the width of aligned columns.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import forkserver
from helpers import worker_env

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CHANGING = [
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "<time>"),
    (re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB)(?= {2})"), "<size>"),
    (re.compile(r" {2,}"), "  "),
]


def _normal(text: str) -> str:
    for pattern, by in CHANGING:
        text = pattern.sub(by, text)
    return text.strip()


def sessions(text: str) -> list[tuple[str, str]]:
    """``(command, output)`` of every ``$ `` line of the page's console blocks, in order."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang != "console":
            continue
        for chunk in re.split(r"^\$ ", body, flags=re.MULTILINE)[1:]:
            command, _, output = chunk.partition("\n")
            out.append((command, output))
    return out


def test_the_page_shows_what_each_command_prints(tmp_path):
    """Every command docs/cli.md shows prints what the page says, run on the folder the page's Python block
    makes. Slow (tens of seconds): the block and each command run as their own processes, as a user runs
    them."""
    text = PAGE.read_text()
    [make] = [body for lang, body in FENCE.findall(text) if lang == "python"]
    env = worker_env(devices=1)
    forkserver.run([sys.executable, "-c", make], cwd=tmp_path, env=env, check=True, timeout=300)
    shown = sessions(text)
    commands = {c.split()[1] for c, _ in shown}
    assert commands == {"ls", "info", "verify", "diff", "convert", "prune"}, commands
    flax_ckpt = [sys.executable, "-m", "flax_ckpt"]
    for command, expected in shown:
        argv = shlex.split(command)
        assert argv[0] == "flax-ckpt", command
        r = subprocess.run(
            flax_ckpt + argv[1:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        printed = r.stdout.replace(str(tmp_path), "/home/you")
        assert _normal(printed) == _normal(expected), (
            f"docs/cli.md shows for `{command}`:\n{expected}\nbut it prints:\n{printed}{r.stderr}"
        )

"""The examples of README.md and the guides (docs/*.md) run as they stand.

Every ```python block of a page runs, in page order, in one namespace per page, in a fresh working
folder, after the page's setup below (the names a page's fragments take as given: a pretrained
checkpoint, a target). A block that cannot run here (it needs an S3 server, several processes, or is
run elsewhere as a whole program) is preceded by ``<!-- test: skip (the reason) -->``, which neither
GitHub nor the site shows; a skip without a reason is an error. The loop snippets of docs/resuming.md
run as programs in tests/test_examples.py, the serializer's in tests/test_serializer_api.py.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!-- test: skip \((?P<reason>[^)]+(?:\([^)]*\)[^)]*)*)\)\s*-->\s*$", re.DOTALL)
COMMENT_END = re.compile(r"-->\s*$")

# The names a page's fragments use, made real. Keyed by page name.
SETUP = {
    "finetuning.md": """
import flax_ckpt as fc
import jax
import jax.numpy as jnp
from flax_ckpt.callbacks import CheckpointCallback

pretrained = {"params": {"encoder": {"w": jnp.ones((4, 4))}, "head": {"w": jnp.ones((4, 2))}}}
fc.save("pretrained/300", pretrained)
fc.save("ckpt/300", pretrained)
new_params = {"backbone": {"w": jnp.zeros((4, 4))}, "head": {"w": jnp.zeros((4, 10))}}
abstract_bf16_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), pretrained)
state = {**jax.tree.map(jnp.zeros_like, pretrained), "opt": {"mu": jnp.zeros(3)}}
ckpt = CheckpointCallback("finetune_run", every_steps=10)
""",
}


def python_blocks(page: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ```python block of ``page``."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[: m.start()].rstrip()
        skip = SKIP.search(before)
        if COMMENT_END.search(before) and "<!-- test:" in before[before.rfind("<!--") :]:
            assert skip, (
                f"{page.name}: a test comment before line {text.count(chr(10), 0, m.start()) + 1} "
                "must read <!-- test: skip (reason) -->"
            )
        out.append((text.count("\n", 0, m.start()) + 2, m.group(2), skip.group("reason") if skip else None))
    return out


OUTPUT = re.compile(r"<!-- test: output -->\s*$")


def expected_outputs(page: pathlib.Path) -> dict[int, str]:
    """``{line of a python block: the text it must print}``, for each ```text block that a
    ``<!-- test: output -->`` comment marks as the output of the python block before it."""
    text, out, last = page.read_text(), {}, None
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 2
        if m.group(1) == "python":
            last = line
        elif m.group(1) == "text" and OUTPUT.search(text[: m.start()]):
            assert last is not None, f"{page.name}:{line}: an output with no python block before it"
            out[last] = m.group(2)
    return out


def _close_open(ns: dict) -> None:
    """Closes the managers and callbacks a page's examples left open (their locks, their handlers)."""
    import flax_ckpt as fc
    from flax_ckpt.callbacks import CheckpointCallback

    for value in ns.values():
        if isinstance(value, (fc.CheckpointManager, CheckpointCallback)):
            value.close()


def run_page(page: pathlib.Path) -> None:
    """Runs the page's setup and its ```python blocks that are not skipped, in one namespace."""
    ns: dict = {"__name__": f"guide_{page.stem}"}
    outputs = expected_outputs(page)
    try:
        exec(compile(SETUP.get(page.name, ""), f"<setup of {page.name}>", "exec"), ns)
        for line, code, reason in python_blocks(page):
            if reason is None:
                printed = io.StringIO()
                try:
                    with contextlib.redirect_stdout(printed):
                        exec(compile(code, f"{page.name}:{line}", "exec"), ns)
                    if line in outputs:
                        assert printed.getvalue() == outputs[line], (
                            f"{page.name}:{line} prints\n{printed.getvalue()}but the page shows\n{outputs[line]}"
                        )
                except ModuleNotFoundError as e:
                    if e.name and e.name.split(".")[0] in ("orbax", "grain"):
                        pytest.skip(f"{page.name}:{line} needs {e.name.split('.')[0]} (the test extra)")
                    raise
    finally:
        _close_open(ns)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(r is None for _, _, r in python_blocks(p))], ids=lambda p: p.name
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)


def test_every_skipped_example_says_why_and_most_run():
    blocks = [(p.name, line, reason) for p in PAGES for line, _, reason in python_blocks(p)]
    skipped = [b for b in blocks if b[2] is not None]
    assert all(len(reason.split()) >= 3 for _, _, reason in skipped), skipped
    assert len(skipped) * 2 < len(blocks), f"most examples should run here: {skipped}"


def test_a_failing_example_fails_the_test(tmp_path):
    """The runner runs every block that is not skipped and reports one that raises, by page and line."""
    page = tmp_path / "broken.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\n<!-- test: skip (not run on purpose here) -->\n"
        "```python\nraise KeyError('skipped')\n```\n\n```python\nraise ValueError(x)\n```\n"
    )
    assert [(line, reason) for line, _, reason in python_blocks(page)] == [
        (4, None),
        (9, "not run on purpose here"),
        (13, None),
    ]
    with pytest.raises(ValueError, match="^1$") as info:
        run_page(page)
    assert traceback.extract_tb(info.value.__traceback__)[-1].filename == "broken.md:13"
    page.write_text("```python\nx = 1\n```\n\n<!-- test: skip -->\n```python\nx = 2\n```\n")
    with pytest.raises(AssertionError, match="must read <!-- test: skip"):
        python_blocks(page)


def test_a_shown_output_is_what_the_example_prints(tmp_path):
    page = tmp_path / "out.md"
    page.write_text("```python\nprint(1 + 1)\n```\n\nIt prints:\n\n<!-- test: output -->\n```text\n2\n```\n")
    run_page(page)
    page.write_text(page.read_text().replace("```text\n2", "```text\n3"))
    with pytest.raises(AssertionError, match="out.md:2 prints"):
        run_page(page)


def test_every_command_line_shown_uses_options_the_command_has():
    """Each ``flax-ckpt <command> ...`` line of a bash block names a real command and only options its
    ``--help`` lists (the command answers --help without importing jax)."""
    import subprocess
    import sys

    shown: dict[str, set[str]] = {}
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text()):
            for line in body.splitlines() if lang == "bash" else []:
                words = line.split("#")[0].split()
                if len(words) >= 2 and words[0] == "flax-ckpt":
                    options = {w.split("=")[0] for w in words if w.startswith("--")}
                    shown.setdefault(words[1], set()).update(options)
    assert {"ls", "info", "verify", "diff", "convert", "prune"} <= set(shown), sorted(shown)
    for command, options in sorted(shown.items()):
        out = subprocess.run(
            [sys.executable, "-m", "flax_ckpt", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, f"flax-ckpt {command} --help: {out.stderr[-500:]}"
        assert [o for o in sorted(options) if o not in out.stdout] == [], f"flax-ckpt {command}"

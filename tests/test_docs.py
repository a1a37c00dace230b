"""Issue 35: the README and docs/ stay true to the code. Every relative link (and #anchor) resolves, no path of a
machine appears, the README names every subcommand and stays a page (<= 250 lines), and docs/commands.md's usage
block is what `shardkit <command> --help` prints."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "scripts" / "BENCH.md"]
USAGE_COLUMNS = "118"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    out, seen, fence = set(), {}, False
    for line in page.read_text().split("\n"):
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_every_relative_link_resolves():
    bad = []
    for page in DOCS:
        for link in _links(page):
            if re.match(r"^[a-z]+://", link) or link.startswith("mailto:"):
                continue
            path, _, frag = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.relative_to(REPO)}: {link} (no such file)")
            elif frag and target.suffix == ".md" and frag not in _anchors(target):
                bad.append(f"{page.relative_to(REPO)}: {link} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A title\n\n[ok](#a-title) [bad](#no-title) [gone](missing.md)\n")
    assert _anchors(page) == {"a-title"}
    assert _links(page) == ["#a-title", "#no-title", "missing.md"]


MACHINE = re.compile(r"(?<![\w.$-])/(?:work|tmp|root|home|scratch)/|\S/\.venv/bin/|/site-packages/")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_machine_paths(page):
    hits = [f"{page.relative_to(REPO)}:{i}: {line.strip()[:120]}" for i, line in
            enumerate(page.read_text().split("\n"), 1) if MACHINE.search(line)]
    assert not hits, "\n".join(hits)


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    acts = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(acts[0].choices) if acts else {}


def _commands(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Every leaf subcommand ("convert hf-to-mcore", "reshard", ...) and its parser, formatted at a fixed width."""
    monkeypatch.setenv("COLUMNS", USAGE_COLUMNS)
    from shardkit.cli import build_parser

    out = {}
    for name, sub in _subparsers(build_parser()).items():
        inner = _subparsers(sub)
        out.update({f"{name} {n}": s for n, s in inner.items()} if inner else {name: sub})
    return out


def test_readme_names_every_subcommand(monkeypatch):
    readme = (REPO / "README.md").read_text()
    assert len(readme.split("\n")) <= 250
    missing = [c for c in _commands(monkeypatch) if f"`shardkit {c}" not in readme]
    assert not missing, f"README.md's command table lacks {missing}"


def test_commands_md_usage_is_the_help(monkeypatch):
    """docs/commands.md's "Usage" block equals the parsers' usage. Regenerate it, when a flag changes, with
    `for c in <each command>; do COLUMNS=118 shardkit $c --help | sed -n '1,/^$/p' | sed '/^$/d'; done`."""
    text = (REPO / "docs" / "commands.md").read_text()
    block = re.search(r"^## Usage\n.*?```\n(.*?)```", text, flags=re.S | re.M)
    assert block, "docs/commands.md has no Usage block"
    documented = {}
    for chunk in re.split(r"(?m)^(?=usage: )", block.group(1)):
        if chunk.strip():
            documented[re.match(r"usage: shardkit ([\w-]+(?: [\w-]+)?) \[", chunk).group(1)] = chunk.rstrip()
    for cmd, parser in _commands(monkeypatch).items():
        if cmd == "continue-pretrain":  # its flags: its --help and docs/TRAINING_FLAGS.md
            continue
        assert cmd in documented, f"docs/commands.md's Usage block lacks `shardkit {cmd}`"
        assert documented[cmd] == parser.format_usage().rstrip(), f"`shardkit {cmd}`: usage differs from --help"


def test_planning_md_slurm_example_is_launchs_output(capsys):
    """docs/planning.md shows `shardkit launch --slurm --dry-run`'s output "unedited": it must be what launch prints
    today. When a template changes, paste the new output of the command shown there."""
    import shlex

    from shardkit.cli import main

    text = (REPO / "docs" / "planning.md").read_text()
    example = re.search(r"unedited.*?```\n(shardkit launch .*?)```\n\n```bash\n(.*?)```", text, flags=re.S)
    assert example, "docs/planning.md: no launch example followed by its output"
    argv = shlex.split(example.group(1).replace("\\\n", " "))[1:]
    assert main(argv) == 0
    assert capsys.readouterr().out == example.group(2), "docs/planning.md's SLURM example differs from launch's output"

"""The docs site: ``mkdocs build --strict`` passes on the shipped pages and fails on a broken link, a missing anchor
or a page out of the nav; every page is in the nav or excluded with its reason; the generated reference matches the
code (``scripts/docs_reference.py --check``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e .[docs]) builds the site")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra (pip install -e .[docs]) builds the site")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "docs_reference.py"
#: Generous: a build takes about 2 s here.
BUILD_TIMEOUT_S = 300


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    environment = os.environ | {"NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner, not a build message
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)]
    command += ["--site-dir", str(site)]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=BUILD_TIMEOUT_S)


def site_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """A copy of ``docs/`` and of ``mkdocs.yml`` pointing at it (and at the repo's code for the API pages)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = site_config()
    config["docs_dir"] = str(tmp_path / "docs")
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return tmp_path


def test_the_site_builds_strict_with_the_api_pages_rendered(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "moe" / "index.html").read_text()
    assert 'id="mmoe.moe.MoEConfig"' in api  # mkdocstrings rendered the class, not just the directive
    commands = (tmp_path / "site" / "reference" / "commands" / "index.html").read_text()
    assert "--moe.num_experts" in commands and "mmoe data convert vqav2" in commands


#: Each breakage: the page it goes in, the text appended, and what the build's warning must name.
BREAKAGES = {
    "a link to a page that does not exist": ("routers.md", "\nSee [a page](no_such_page.md).\n", "no_such_page.md"),
    "a link to an anchor that does not exist": ("routers.md", "\nSee [it](harness.md#no-such-part).\n", "no-such-part"),
    "a link out of the docs folder": ("routers.md", "\nSee [the README](../README.md).\n", "../README.md"),
    "a page in neither the nav nor not_in_nav": ("orphan.md", "# A page nobody reaches\n", "orphan.md"),
}


def test_the_copy_of_the_docs_builds(docs_copy):
    """The breakages below are made in such a copy: intact, it builds."""
    result = build(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_strict_build_fails_on_a_broken_page(docs_copy, breakage):
    page, text, named = BREAKAGES[breakage]
    with (docs_copy / "docs" / page).open("a") as file:
        file.write(text)
    result = build(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert result.returncode != 0
    assert "WARNING" in result.stderr, result.stderr[-3000:]
    assert named in result.stderr[result.stderr.index("WARNING") :], result.stderr[-3000:]  # its own warning


def nav_pages(entries: list) -> set[str]:
    pages = set()
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def excluded_with_reasons(not_in_nav: str) -> dict[str, str]:
    """The ``not_in_nav`` patterns, each with the comment line above it (its reason; empty when none)."""
    excluded, reason = {}, ""
    for line in not_in_nav.splitlines():
        line = line.strip()
        if line.startswith("#"):
            reason = line.lstrip("# ")
        elif line:
            excluded[line.lstrip("/")] = reason
            reason = ""
    return excluded


def test_every_page_is_in_the_nav_or_excluded_with_a_reason():
    config = site_config()
    listed = nav_pages(config["nav"])
    excluded = excluded_with_reasons(config.get("not_in_nav", ""))
    assert all(excluded.values()), f"not_in_nav entries without a reason comment above them: {excluded}"
    pages = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md")}
    assert pages - listed - set(excluded) == set()
    assert listed - pages == set(), "nav entries without a page"
    assert set(excluded) <= pages, "not_in_nav entries without a page"


@pytest.mark.slow
def test_the_generated_reference_matches_the_code():
    """``--check`` passes on the committed pages (a changed option or field fails it until the pages are rewritten)."""
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def load_script(name: str = "docs_reference"):
    """A script of ``scripts/`` imported as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_names_each_stale_page(tmp_path):
    script = load_script()
    reference = tmp_path / "docs" / "reference"
    (reference / "api").mkdir(parents=True)
    pages = {reference / "same.md": f"{script.GENERATED}\nA\n", reference / "changed.md": f"{script.GENERATED}\nB\nC\n"}
    pages[reference / "missing.md"] = "x\n"
    (reference / "same.md").write_text(pages[reference / "same.md"])
    (reference / "changed.md").write_text(f"{script.GENERATED}\nB\nD\n")
    (reference / "api" / "left_over.md").write_text(f"{script.GENERATED}\nold\n")
    (reference / "by_hand.md").write_text("# written by hand\n")
    assert script.stale_pages(pages, reference) == [
        "docs/reference/changed.md differs in 2 lines",
        "docs/reference/missing.md missing",
        "docs/reference/api/left_over.md is no longer generated",
    ]


def test_config_page_rows_hold_type_default_and_the_docstring_entry():
    script = load_script()
    section = "\n".join(script.config_section("mmoe.moe.MoEConfig", "one MoE layer"))
    assert "| `dim` | `int` | required | token width D. |" in section
    assert "| `num_experts` | `int` | `8` | number of experts N (for Stratified MoE, the sum over strata). |" in section
    assert section.index("`dim`") < section.index("`num_experts`") < section.index("`router_jitter`")  # own first
    assert "`head_dim`" not in section  # derived, not set


def test_table_cells_keep_code_spans_and_escape_the_rest():
    script = load_script()
    cell = script.cell("p(e | x), see :class:`~mmoe.moe.MoEConfig` and ``a | b``, not <class 'x'>")
    assert cell == "p(e \\| x), see `mmoe.moe.MoEConfig` and ``a | b``, not &lt;class 'x'>"


def test_the_moe_speed_table_is_the_shipped_runs_and_a_changed_cell_is_stale(tmp_path, monkeypatch):
    moe_speed_table = load_script("moe_speed_table")
    assert moe_speed_table.main(["--check"]) == 0
    block = moe_speed_table.table()
    # Every case of both runs is a row, each cell read from the files (one thread / two threads).
    one = moe_speed_table.cases(moe_speed_table.RUNS[0])
    assert [row.split("|")[1].strip(" `") for row in block.splitlines()[2:]] == list(one)
    top8 = next(row for row in block.splitlines() if "fine_grained_e64_top8_4096" in row)
    assert f"{one['fine_grained_e64_top8_4096']['balanced_floor_ratio']:.2f} / " in top8
    page = tmp_path / "page.md"
    page.write_text(moe_speed_table.PAGE.read_text().replace(top8, top8.replace("|", "| 9.99 |", 1)))
    monkeypatch.setattr(moe_speed_table, "PAGE", page)
    assert moe_speed_table.main(["--check"]) == 1
    page.write_text(page.read_text().replace(moe_speed_table.END, ""))  # a page that lost its end marker
    assert moe_speed_table.main(["--check"]) == 2


def test_the_architecture_figure_script_writes_a_drawn_png(tmp_path):
    """``scripts/architecture_figure.py`` (docs/explanations/architecture.png) draws from the shipped config part."""
    from PIL import Image

    architecture_figure = load_script("architecture_figure")
    out = tmp_path / "figures" / "architecture.png"
    assert architecture_figure.main(["--out", str(out)]) == 0
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.width > 1000 and image.height > 500
        colours = image.convert("RGB").getcolors(maxcolors=image.width * image.height)
    # Boxes in several fills, text and lines: many colours, and the background alone covers at most 90 % of it.
    assert len(colours) > 50
    assert max(count for count, _ in colours) < 0.9 * sum(count for count, _ in colours)

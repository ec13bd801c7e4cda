"""The README's matrix table mirrors images/matrix.toml: a version changed in one place only fails here."""

import re

from stackproof.images import bake
from stackproof.images.matrix import REPO_ROOT, load_matrix


def matrix_rows():
    matrix = load_matrix()
    for image in matrix.images:
        name = f"**{image.name}** (default)" if image.name == matrix.default else image.name
        yield (f"| {name} | {image.flavor} | {image.base} | {image.python} | {image.torch} | {image.torchvision} "
               f"| {image.cuda} | {image.cudnn} | {image.nccl} |")


def test_readme_matrix_table_equals_the_matrix():
    readme = (REPO_ROOT / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| ") and line.count("|") == 10][1:]
    assert table == list(matrix_rows()), "update the README's matrix table from images/matrix.toml"


def test_readme_quickstart_names_the_default_validation_image():
    readme = (REPO_ROOT / "README.md").read_text()
    image = load_matrix().default_image
    versioned = set(re.findall(r"stackproof/(?:validation|pytorch):\d[\w.-]*", readme))
    assert bake.validation_tag(image) in versioned
    assert versioned <= {bake.validation_tag(image), image.tag}, "a tag in the README is not the matrix default's"


def test_readme_exit_codes_are_the_cli_exit_codes():
    from stackproof.errors import Exit

    readme = (REPO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d) \| (.+) \|$", readme, re.M)
    assert rows == [(str(int(code)), code.meaning) for code in Exit]


def test_readme_says_what_baseline_and_act_do():
    """Issue 30 item 20: a baseline's tolerances are each figure's own (from the known-good spread, docs/
    baseline.md), not one 5 %; Kubernetes taints only the nodes to drain, not every failed one."""
    readme = (REPO_ROOT / "README.md").read_text()
    baseline = next(line for line in readme.splitlines() if line.startswith("stackproof validate --baseline"))
    assert "5 %" not in baseline and "tolerance (from the spread)" in baseline, baseline
    assert "taint the failed ones" not in readme and "taint those to drain" in readme

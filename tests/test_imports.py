"""Imports run one way (STYLE.md): cli -> stages -> library; only cli.py and stages/ see Hydra/OmegaConf;
stages do not import each other (their shared helpers live in checks.py, console.py, factories.py, prompts.py, model_loading.py,
warm_cache.py, run_dirs.py, rules.py, planning.py, train_state.py, train_parity.py, train_summary.py and sweep.py)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smd_cli"
STAGE_HELPERS = {"checks", "console", "factories", "prompts", "model_loading", "warm_cache", "run_dirs", "rules", "planning",
                 "train_state", "train_parity", "train_summary", "sweep"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_library_code_never_sees_hydra_or_the_stages():
    library = [p for p in PACKAGE.rglob("*.py") if "stages" not in p.parts and p.name != "cli.py"]
    assert len(library) >= 25
    for path in library:
        bad = {m for m in imports(path) if m.split(".")[0] in ("hydra", "omegaconf") or m.startswith("smd_cli.stages") or m == "smd_cli.cli"}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_stages_do_not_import_each_other():
    stages = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__"}
    assert {"prepare_data", "rollout", "train", "evaluate", "ablate"} <= stages
    for name in stages - STAGE_HELPERS:
        used = {m.split(".")[2] for m in imports(PACKAGE / "stages" / f"{name}.py") if m.startswith("smd_cli.stages.")}
        assert used <= STAGE_HELPERS, f"stages/{name}.py imports stages {sorted(used - STAGE_HELPERS)}"


def test_a_sweep_and_its_launcher_workers_never_import_torch():
    """`smd ablate` and a joblib worker of it (`sweep.run_member`, which starts each member as an `smd train` process)
    check configs and files only, so they import neither torch nor transformers (seconds and hundreds of MB each)."""
    import subprocess
    import sys

    code = ("import sys, smd_cli.stages.ablate, smd_cli.stages.sweep, smd_cli.sweep_tables, smd_cli.stages.rules;"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert done.stdout.strip() == "[]"


def test_smd_reproduce_starts_without_transformers():
    """`smd reproduce` starts `smd ablate` processes and writes the report: the CLI names the engine's failures
    (`smd_cli.failures`) without importing the engine, so transformers (seconds at each start) is never loaded."""
    import subprocess
    import sys

    code = ("import sys; from smd_cli.cli import main\ntry: main(['reproduce', '--help'])\nexcept SystemExit as done: assert not done.code\n"
            "import smd_cli.stages.reproduce\nprint('loaded:', [m for m in ('transformers', 'smd_cli.models') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "loaded: []"

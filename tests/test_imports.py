"""Imports run one way (STYLE.md; the README's layout map): each package of smd_cli imports only packages below it in
LAYERS; only `cli.py`, `stages/`, `runs/` and `config/` see Hydra/OmegaConf; stages do not import each other."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "smd_cli"
# Highest first. A module may import its own package and any package after it in this list, never one before it.
# `integrations` (optional extras: TRL) sits above every engine package it uses and is imported by nothing (tested below).
LAYERS = ["cli", "stages", "runs", "config", "integrations", "report", "checks", "evaluation", "learner", "corrections", "rollout",
          "eviction", "tasks", "model", "attention", "runtime", "options"]
HYDRA_SIDE = {"cli", "stages", "runs", "config"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE]


def test_every_module_sits_in_a_layer_and_the_top_level_holds_only_the_cli_and_the_options():
    assert {layer(p) for p in modules()} <= set(LAYERS), {layer(p) for p in modules()} - set(LAYERS)
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "cli.py", "options.py"]
    assert all((PACKAGE / name / "__init__.py").is_file() for name in LAYERS if (PACKAGE / name).is_dir())


def test_packages_import_only_packages_below_them():
    wrong = []
    for path in modules():
        mine = LAYERS.index(layer(path))
        for module in imports(path):
            parts = module.split(".")
            if parts[0] != "smd_cli" or len(parts) < 2 or parts[1] not in LAYERS:
                continue
            if LAYERS.index(parts[1]) < mine:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_library_code_never_sees_hydra():
    library = [p for p in modules() if layer(p) not in HYDRA_SIDE]
    assert len(library) >= 60
    for path in library:
        bad = {m for m in imports(path) if m.split(".")[0] in ("hydra", "omegaconf")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_stages_are_entry_points_that_do_not_import_each_other():
    stages = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__"}
    assert stages == {"prepare_data", "rollout", "check_parity", "train", "evaluate", "ablate", "plan", "reproduce"}
    for name in stages:
        used = {m for m in imports(PACKAGE / "stages" / f"{name}.py") if m.startswith("smd_cli.stages.")}
        assert not used, f"stages/{name}.py imports {sorted(used)}"


def test_a_sweep_and_its_launcher_workers_never_import_torch():
    """`smd ablate` and a joblib worker of it (`sweep.run_member`, which starts each member as an `smd train` process)
    check configs and files only, so they import neither torch nor transformers (seconds and hundreds of MB each)."""
    import subprocess
    import sys

    code = ("import sys, smd_cli.stages.ablate, smd_cli.runs.sweep, smd_cli.report.sweep_tables, smd_cli.config.rules;"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert done.stdout.strip() == "[]"


def test_smd_reproduce_starts_without_transformers():
    """`smd reproduce` starts `smd ablate` processes and writes the report: the CLI names the engine's failures
    (`smd_cli.runtime.failures`) without importing the engine, so transformers (seconds at each start) is never loaded."""
    import subprocess
    import sys

    code = ("import sys; from smd_cli.cli import main\ntry: main(['reproduce', '--help'])\nexcept SystemExit as done: assert not done.code\n"
            "import smd_cli.stages.reproduce\nprint('loaded:', [m for m in ('transformers', 'smd_cli.model.build') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "loaded: []"


def test_nothing_in_smd_cli_imports_the_integrations():
    """`integrations` (SMD inside other libraries' trainers, optional extras such as TRL) may import any engine package and
    is imported by none: the engine and the stages run without those extras installed."""
    users = [f"{p.relative_to(PACKAGE)} imports {m}" for p in modules() if layer(p) != "integrations"
             for m in imports(p) if m.startswith("smd_cli.integrations")]
    assert not users, users

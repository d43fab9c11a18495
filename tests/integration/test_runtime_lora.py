"""Runtime LoRA management as vLLM serves it (ALLOW_RUNTIME_LORA_UPDATING): load and unload over HTTP,
behind the API key, then the adapter serves by name on both doors, as peft's own model answers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import openai
import pytest

from tests.fixtures.adapters import write_lora
from tests.integration import reference
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
NEW_TOKENS = 8
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def server(model_dirs) -> Iterator[ServerThread]:
    # No PREFIX_STORE_PATH: the store then serves runtime adapters alone.
    server = ServerThread(
        model_dirs("llama"), allow_runtime_lora_updating=True, api_key=KEY, served_model_name="tiny"
    )
    yield server
    server.stop()


def post(server: ServerThread, path: str, body: dict, headers: dict[str, str] = AUTH) -> tuple[int, str]:
    status, _, raw = server.http_post(path, json.dumps(body).encode(), headers)
    return status, raw.decode()


def test_load_serve_and_unload_an_adapter(server, model_dirs, tmp_path) -> None:
    model_dir = model_dirs("llama")
    adapter = write_lora(tmp_path, "mine", model_dir, seed=1)
    load = {"lora_name": "mine", "lora_path": str(adapter)}
    status, body = post(server, "/v1/load_lora_adapter", load, headers={})
    assert status == 401  # the generation routes' guard
    assert post(server, "/v1/load_lora_adapter", load) == (
        200,
        "Success: LoRA adapter 'mine' added successfully.",
    )
    status, body = post(server, "/v1/load_lora_adapter", load)
    assert (
        status == 400
        and json.loads(body)["error"]["message"] == "The lora adapter 'mine' has already been loaded."
    )

    client = server.openai_client(KEY)
    assert [m.id for m in client.models.list()] == ["tiny", "mine"]
    expected = reference.greedy_with_lora(model_dir, adapter, PROMPT, NEW_TOKENS)
    assert expected.text != reference.greedy(model_dir, PROMPT, NEW_TOKENS).text
    reply = client.completions.create(model="mine", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].text == expected.text
    request = pb.BatchedGenerationRequest(
        adapter_id="mine",
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS)),
        requests=[pb.GenerationRequest(text=PROMPT)],
    )
    grpc_reply = server.stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
    assert grpc_reply.responses[0].text == expected.text

    unload = {"lora_name": "mine"}
    assert post(server, "/v1/unload_lora_adapter", unload) == (
        200,
        "Success: LoRA adapter 'mine' removed successfully.",
    )
    status, body = post(server, "/v1/unload_lora_adapter", unload)
    assert (
        status == 404 and json.loads(body)["error"]["message"] == "The lora adapter 'mine' cannot be found."
    )
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mine", prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        raised.value.details() == "can't retrieve prompt prefix with id 'mine': prefix id \"mine\" not found"
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (LOAD, {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        (LOAD, {"lora_name": "x", "lora_path": "/nonexistent/dir"}, 404, "No adapter found"),
        (LOAD, {"lora_name": "bad name", "lora_path": "/tmp"}, 400, "Invalid prefix id bad name"),
        (LOAD, {"lora_name": "tiny", "lora_path": "/tmp"}, 400, "has already been loaded"),
        (UNLOAD, {"lora_name": "x", "lora_int_id": 3}, 400, "lora_int_id is not supported"),
        (UNLOAD, {}, 400, "'lora_name' must be provided."),
    ],
)  # fmt: skip
def test_bad_adapter_requests_say_why(server, path, body, status, message) -> None:
    got, text = post(server, path, body)
    assert got == status and message in json.loads(text)["error"]["message"], text


def test_a_directory_without_a_lora_adapter_is_refused_and_not_kept(server, tmp_path) -> None:
    (tmp_path / "decoder.pt").write_bytes(b"")
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "prefix", "lora_path": str(tmp_path)})
    assert status == 400, text
    client = server.openai_client(KEY)
    assert "prefix" not in [m.id for m in client.models.list()]

"""vllm-tgis-adapter's switches: ADD_SPECIAL_TOKENS, DISABLE_PROMPT_LOGPROBS, TERMINATION_LOG_DIR and the
`grpc_healthcheck` console script."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ServerThread
from tgis.cli import termination_log_path
from tgis.pb import generation_pb2 as pb

HEALTHCHECK = shutil.which("grpc_healthcheck", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def plain(model_dirs) -> Iterator[ServerThread]:
    server = ServerThread(model_dirs("llama"))
    yield server
    server.stop()


def tokenize(server: ServerThread, text: str) -> list[str]:
    reply = server.stub.Tokenize(
        pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)], return_tokens=True), timeout=30
    )
    return list(reply.responses[0].tokens)


def input_details(server: ServerThread) -> pb.GenerationResponse:
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=1),
        response=pb.ResponseOptions(
            input_tokens=True, generated_tokens=True, token_logprobs=True, top_n_tokens=2
        ),
    )
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hello there")], params=params)
    return server.stub.Generate(request, timeout=60).responses[0]


def test_add_special_tokens_false_leaves_out_the_bos(plain: ServerThread, model_dirs) -> None:
    with_bos = tokenize(plain, "hello there")
    server = ServerThread(model_dirs("llama"), add_special_tokens=False)
    try:
        without = tokenize(server, "hello there")
        assert with_bos == ["<s>", *without]
        assert input_details(server).input_token_count == len(without)
        status, _, body = server.http_post("/tokenize", json.dumps({"inputs": "hello there"}).encode())
        assert status == 200 and len(json.loads(body)) == len(without)
    finally:
        server.stop()
    assert input_details(plain).input_token_count == len(with_bos)


def test_disable_prompt_logprobs_returns_the_input_tokens_without_scores(
    plain: ServerThread, model_dirs
) -> None:
    scored = input_details(plain)
    assert any(token.logprob != 0 for token in scored.input_tokens[1:])
    assert all(len(token.top_tokens) == 2 for token in scored.input_tokens[1:])
    server = ServerThread(model_dirs("llama"), disable_prompt_logprobs=True)
    try:
        bare = input_details(server)
    finally:
        server.stop()
    assert [t.text for t in bare.input_tokens] == [t.text for t in scored.input_tokens]
    # No score, as for a seq2seq model's input tokens: NaN, and no top tokens.
    assert all(math.isnan(t.logprob) and not t.top_tokens for t in bare.input_tokens)
    assert bare.tokens[0].logprob != 0  # generated tokens keep theirs


def test_termination_log_dir_wins_and_may_name_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "msg"
    assert termination_log_path({"TERMINATION_LOG_DIR": str(file), "TERMINATION_MESSAGE_PATH": "/x"}) == str(
        file
    )
    assert termination_log_path({"TERMINATION_LOG_DIR": str(tmp_path)}) == str(tmp_path / "termination-log")
    assert termination_log_path({"TERMINATION_MESSAGE_PATH": "/x"}) == "/x"
    assert termination_log_path({}) == "/dev/termination-log"


def test_grpc_healthcheck_exits_zero_on_serving_and_one_without_a_server(plain: ServerThread) -> None:
    assert HEALTHCHECK is not None, "grpc_healthcheck is not installed beside this Python"
    url = f"localhost:{plain.server.grpc_port}"
    served = subprocess.run([HEALTHCHECK, "--server-url", url], capture_output=True, text=True, timeout=60)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "SERVING" in served.stdout
    unknown = subprocess.run(
        [HEALTHCHECK, "--server-url", url, "--service-name", "no.such.Service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout

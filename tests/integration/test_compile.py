"""PT2_COMPILE (SPEC §7): the compiled forward is warmed up at startup, then serves without recompiling."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engines.compiled import compiled_graphs
from tests.integration import reference
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

PROMPTS = ("Hi", "The quick brown fox jumps over the lazy dog again and again", "naïve café 👍🏽", "x " * 20)


@pytest.mark.slow
def test_compiled_server_answers_like_transformers_without_recompiling(model_dirs):
    model_dir = model_dirs("gpt2")
    server = ServerThread(
        model_dir, pt2_compile=True, max_batch_size=4, max_sequence_length=64, max_new_tokens=16
    )
    try:
        warmed = compiled_graphs()
        assert warmed > 0  # the forward really went through torch.compile at startup

        def generate(text: str, new_tokens: int) -> pb.GenerationResponse:
            request = pb.BatchedGenerationRequest(
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=new_tokens)),
                requests=[pb.GenerationRequest(text=text)],
            )
            return server.stub.Generate(request, timeout=300).responses[0]

        cases = [(text, new_tokens) for text in PROMPTS for new_tokens in (1, 7)]
        with ThreadPoolExecutor(len(cases)) as pool:  # mixed batch sizes, joins and prunes
            answers = list(pool.map(lambda case: generate(*case), cases))
        for (text, new_tokens), answer in zip(cases, answers, strict=True):
            expected = reference.greedy(model_dir, text, new_tokens)
            assert answer.text == expected.text
            assert answer.generated_token_count == expected.generated_token_count
        assert compiled_graphs() == warmed, "serving compiled a shape the warm-up missed"
    finally:
        server.stop()
